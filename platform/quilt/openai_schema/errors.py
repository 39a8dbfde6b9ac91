"""The /v1 API's error answers: OpenAI's error body, the statuses the gateway answers with and the codes behind each,
and the headers that come with them (x-request-id, x-ratelimit-*, Retry-After)."""

from quilt.openai_schema.shapes import nullable, obj, ref, text

# status -> the error types it may carry
TYPES = {
    "400": ("invalid_request_error",), "401": ("invalid_request_error",), "403": ("permission_error",),
    "404": ("invalid_request_error",), "405": ("invalid_request_error",), "409": ("invalid_request_error",),
    "413": ("invalid_request_error",), "415": ("invalid_request_error",),
    "429": ("rate_limit_error", "insufficient_quota"), "500": ("server_error",), "502": ("server_error",),
    "503": ("server_error",),
}  # fmt: skip
_BY_TYPE = {kind: [status for status, kinds in TYPES.items() if kind in kinds] for kinds in TYPES.values()
            for kind in kinds}  # fmt: skip

ERROR = obj({
    "error": obj({
        "message": text("What went wrong, for a person to read."),
        "type": text(", ".join(f"`{kind}` ({', '.join(statuses)})" for kind, statuses in _BY_TYPE.items()) + ".",
                     enum=list(_BY_TYPE)),
        "param": nullable(text("The request field at fault, as a dotted path (`messages.[2].content`, "
                               "`tools[0].function.name`, `response_format.json_schema.name`), or null.")),
        "code": nullable(text("A short machine-readable reason (listed under each status), or null.")),
    }, ("message", "type", "param", "code"), closed=True),
}, ("error",), closed=True, description="OpenAI's error body: the `openai` package raises it as an `APIError` "
                                        "subclass by status (`BadRequestError`, `AuthenticationError`, ...).")

REQUEST_ID = {"description": "The id the request log knows this request by (the chat completion's id is "
                             "`chatcmpl-` followed by it).", "schema": text()}
RATE_LIMIT = {
    "x-ratelimit-limit-requests": {"description": "Requests per minute the window that decided allows: on a "
                                                  "refusal, the window that refused it (the tenant's plan's or the "
                                                  "key's own); on an admitted call, of the plan's and the key's own "
                                                  "limits, the one with fewer requests left. Absent when unlimited.",
                                   "schema": text(pattern="^[0-9]+$")},
    "x-ratelimit-remaining-requests": {"description": "Requests left in the current minute.",
                                       "schema": text(pattern="^[0-9]+$")},
    "x-ratelimit-reset-requests": {"description": "Time until the window resets, in seconds with a unit: `12.345s`.",
                                   "schema": text(pattern="^[0-9]+(\\.[0-9]+)?s$")},
    "x-ratelimit-limit-tokens": {"description": "Tokens per minute allowed (prompt plus `max_tokens`), chosen as "
                                                "x-ratelimit-limit-requests is. Absent when unlimited.",
                                 "schema": text(pattern="^[0-9]+$")},
    "x-ratelimit-remaining-tokens": {"description": "Tokens left in the current minute.",
                                     "schema": text(pattern="^[0-9]+$")},
    "x-ratelimit-reset-tokens": {"description": "As x-ratelimit-reset-requests.",
                                 "schema": text(pattern="^[0-9]+(\\.[0-9]+)?s$")},
}  # fmt: skip
RETRY_AFTER = {"description": "Seconds to wait before retrying (until the month's end for `insufficient_quota`).",
               "schema": text(pattern="^[0-9]+$")}

STATUSES = {
    "400": "The request is invalid; `param` names the field. Codes: null (a field of the wrong type or out of "
           "range, an unknown field: `Unrecognized request argument supplied`), `unsupported_parameter` (a field "
           "OpenAI knows that this server does not serve: `functions`, `function_call`, `audio`, `prediction`, "
           "`web_search_options`, `reasoning_effort`, `suffix`, image or audio content parts, `best_of` other than "
           "`n`), `invalid_value`, `context_length_exceeded` (the prompt and `max_tokens` don't fit the model's "
           "context), and the engine's own refusals (a `response_format` or tool schema it can't compile, a "
           "`logit_bias` token past the vocabulary). Fine-tuning adds `invalid_purpose`, `invalid_file_format`, "
           "`invalid_multipart`, `file_missing`, `invalid_training_file`, `invalid_validation_file`, "
           "`invalid_hyperparameter`, `invalid_suffix`, `invalid_seed`, `unsupported_method`, `job_not_cancellable`.",
    "401": "No API key, or one that is unknown, revoked or expired (`invalid_api_key`).",
    "403": "The key may not do this: `insufficient_scope` (no `inference` scope), `insufficient_role` (its creator "
           "no longer has a role that allows it), `tenant_suspended`, `model_not_allowed` (the key is limited to "
           "other models); fine-tuning: `file_storage_quota_exceeded`, `adapter_limit_reached`.",
    "404": "`model_not_found` (no base model or adapter of the tenant by that name), `not_found` (no such file or "
           "job), `unknown_url`.",
    "405": "The method is not served on this path (`method_not_allowed`, with an `Allow` header).",
    "409": "A running fine-tuning job uses this file (`file_in_use`).",
    "413": "The request body is too large (`request_too_large`), or the uploaded file is (`file_too_large`).",
    "415": "The body is not JSON (`unsupported_media_type`): send `Content-Type: application/json`.",
    "429": "Admission refused the call. `type: rate_limit_error`, `code: rate_limit_exceeded`: requests or tokens "
           "per minute, concurrent requests, or requests in flight holding the rest of a monthly budget (the "
           "tenant's or the key's); retry after `Retry-After`. `type: insufficient_quota`, `code: "
           "insufficient_quota`: the monthly token budget or spend limit (the tenant's or the key's) is used up. "
           "Fine-tuning: `fine_tuning_job_limit_reached`.",
    "500": "The server failed (`internal_error`).",
    "502": "The engine failed while generating a whole (not streamed) answer (`engine_error`); retry.",
    "503": "No engine can serve the model right now (`engine_unavailable`), the adapter could not be loaded "
           "(`adapter_unavailable`), or a store is briefly unreachable (`service_unavailable`); retry after "
           "`Retry-After`.",
}  # fmt: skip
KEY_UNKNOWN = ("401", "405", "413", "500")  # answered before the key is known: no x-ratelimit-* headers
GENERATION_STATUSES = ("400", "401", "403", "404", "405", "413", "415", "429", "500", "502", "503")
READ_STATUSES = ("400", "401", "403", "404", "405", "429", "500", "503")


def error_responses(statuses: tuple[str, ...], *, request_id: bool) -> dict:
    """The error answers of an operation: each status's description, the error body and its headers."""
    responses = {}
    for status in statuses:
        headers: dict = {"x-request-id": REQUEST_ID} if request_id else {}
        if (request_id and status not in KEY_UNKNOWN) or status == "429":
            headers |= RATE_LIMIT  # once the key is known
        if status in ("429", "503"):
            headers["Retry-After"] = RETRY_AFTER
        if status == "405" and request_id:
            headers["Allow"] = {"description": "The methods this path serves.", "schema": text()}
        responses[status] = {"description": STATUSES[status], "headers": headers,
                             "content": {"application/json": {"schema": ref("OpenAIError")}}}  # fmt: skip
    return responses


STREAM_ERROR = {
    "allOf": [ref("OpenAIError")],
    "description": "An error inside a stream that already answered 200: a `data:` event carrying OpenAI's error body "
                   "(`type: server_error`, `code: engine_error` or `adapter_unavailable`), after which the stream ends "
                   "without `data: [DONE]`.",
}
SCHEMAS = {"OpenAIError": ERROR, "OpenAIStreamError": STREAM_ERROR}
