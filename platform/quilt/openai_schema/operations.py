"""The /v1 operations: each path and method with its parameters, request body, answer and errors. The gateway serves
/v1 with its own async views (not DRF), so the schema generator can't see them: they are described here."""

from quilt.openai_schema import chat, completions, errors, fine_tuning
from quilt.openai_schema.errors import GENERATION_STATUSES, RATE_LIMIT, READ_STATUSES, REQUEST_ID
from quilt.openai_schema.generation import SSE_FRAMING, STREAM_HEADERS
from quilt.openai_schema.shapes import array, boolean, integer, obj, ref, text

INFERENCE, FINE_TUNING = "Inference (OpenAI-compatible)", "Fine-tuning (OpenAI-compatible)"
SCHEMAS = {**errors.SCHEMAS, **chat.SCHEMAS, **completions.SCHEMAS, **fine_tuning.SCHEMAS}
AUTH = "Authenticated by an API key with the `inference` scope, sent as `Authorization: Bearer <key>`."
ADMISSION = (
    "Admission checks the tenant's and the key's limits first (requests and tokens per minute, concurrent "
    "requests, monthly token budget and spend limit): a refusal is a 429 with `Retry-After`. Every answer, a "
    "refusal once the key is known included, carries the `x-ratelimit-*` headers of the window that decided, and "
    "`x-request-id`, the id the request log knows the request by."
)


def _json(name: str) -> dict:
    return {"application/json": {"schema": ref(name)}}


def _generation(*, whole: str, chunk: str, description: str) -> dict:
    event = {"oneOf": [ref(chunk), ref("OpenAIStreamError")], "description": "Each `data:` event's JSON."}
    return {
        "description": description,
        "headers": {"x-request-id": REQUEST_ID, **RATE_LIMIT, **STREAM_HEADERS},
        "content": {**_json(whole), "text/event-stream": {"schema": event}},
    }


def _models(name: str, description: str) -> dict:
    return {"description": description, "headers": {"x-request-id": REQUEST_ID, **RATE_LIMIT},
            "content": _json(name)}  # fmt: skip


def _query(name: str, schema: dict, description: str) -> dict:
    return {"in": "query", "name": name, "required": False, "schema": schema, "description": description}


LIMIT = _query("limit", integer(minimum=1, maximum=100, default=20), "Items per page.")
AFTER = _query("after", text(), "The id of the last item of the previous page.")
PAGE = [LIMIT, AFTER]
FILE_QUERY = [
    _query("purpose", text(enum=["assistants", "assistants_output", "batch", "batch_output", "evals", "fine-tune",
                                 "fine-tune-results", "user_data", "vision"]), "Only files of this purpose."),
    _query("order", text(enum=["asc", "desc"], default="desc"), "By creation time."),
    *PAGE,
]  # fmt: skip
JOB_QUERY = [*PAGE, {"in": "query", "name": "metadata", "required": False, "style": "deepObject", "explode": True,
                     "schema": {"type": "object", "additionalProperties": text()},
                     "description": "`metadata[key]=value`: only jobs with that metadata."}]  # fmt: skip

CHAT = (
    "OpenAI's chat completions, for the `openai` package or any OpenAI client (`base_url` is this server's `/v1`). "
    "The base model's chat template turns `messages` (and `tools`) into the prompt. `response_format` and `tools` "
    "constrain generation, so JSON answers and tool arguments are always valid JSON matching the schema given "
    "(unless `max_tokens` cuts them short). " + ADMISSION + "\n\n" + SSE_FRAMING
)
COMPLETIONS = "OpenAI's legacy completions: a prompt in, text out, no chat template. " + ADMISSION + "\n\n" + SSE_FRAMING

# (method, path, tag, summary, description, path parameter, request body, 200 answer, error statuses, query)
OPERATIONS = [
    ("post", "/v1/chat/completions", INFERENCE, "Create a chat completion", CHAT, None,
     _json("ChatCompletionRequest"),
     _generation(whole="ChatCompletion", chunk="ChatCompletionChunk",
                 description="The answer: a `chat.completion` object, or with `stream: true` a `text/event-stream` "
                             "of `chat.completion.chunk` events."), GENERATION_STATUSES, []),
    ("post", "/v1/completions", INFERENCE, "Create a completion", COMPLETIONS, None, _json("CompletionRequest"),
     _generation(whole="TextCompletion", chunk="TextCompletionChunk",
                 description="A `text_completion` object, or with `stream: true` a `text/event-stream` of "
                             "`text_completion` chunks."), GENERATION_STATUSES, []),
    ("get", "/v1/models", INFERENCE, "List models", "The base models and the tenant's adapters this key may use.",
     None, None, _models("ModelList", "The models."),
     ("401", "403", "405", "500", "503"), []),
    ("get", "/v1/models/{name}", INFERENCE, "Get a model", "One model by name (`support-bot@3` pins a version), if "
     "this key may use it.", "name", None, _models("Model", "The model."),
     ("400", "401", "403", "404", "405", "500", "503"), []),
    ("post", "/v1/files", FINE_TUNING, "Upload a file", "A JSONL file of training examples, checked line by line "
     "at once (a bad line is a 400 that names it).", None,
     {"multipart/form-data": {"schema": fine_tuning.FILE_UPLOAD}}, {"description": "The file.",
                                                                   "content": _json("OpenAIFile")},
     (*READ_STATUSES, "413"), []),
    ("get", "/v1/files", FINE_TUNING, "List files", "The tenant's uploaded files, newest first.", None, None,
     {"description": "A page of files.", "content": _json("OpenAIFileList")}, READ_STATUSES, FILE_QUERY),
    ("get", "/v1/files/{file_id}", FINE_TUNING, "Get a file", "One uploaded file's metadata.", "file_id", None,
     {"description": "The file.", "content": _json("OpenAIFile")}, READ_STATUSES, []),
    ("delete", "/v1/files/{file_id}", FINE_TUNING, "Delete a file", "Deletes an uploaded file.", "file_id", None,
     {"description": "Deleted.", "content": _json("OpenAIFileDeleted")}, (*READ_STATUSES, "409"), []),
    ("get", "/v1/files/{file_id}/content", FINE_TUNING, "Download a file", "The file's bytes as uploaded.",
     "file_id", None, {"description": "The JSONL file.", "content": {"application/jsonl": {
         "schema": text(format="binary")}}}, READ_STATUSES, []),
    ("post", "/v1/fine_tuning/jobs", FINE_TUNING, "Create a fine-tuning job", "Trains a LoRA adapter of a base "
     "model on a training file; when the job succeeds, the adapter named by `suffix` gets a new version (billed by "
     "trained tokens at the plan's training price).", None,
     {"application/json": {"schema": fine_tuning.JOB_REQUEST}}, {"description": "The job, queued.",
                                                                 "content": _json("FineTuningJob")},
     (*READ_STATUSES, "413"), []),
    ("get", "/v1/fine_tuning/jobs", FINE_TUNING, "List fine-tuning jobs", "The tenant's jobs, newest first.", None,
     None, {"description": "A page of jobs.", "content": _json("FineTuningJobList")}, READ_STATUSES, JOB_QUERY),
    ("get", "/v1/fine_tuning/jobs/{job_id}", FINE_TUNING, "Get a fine-tuning job", "One job's state.", "job_id",
     None, {"description": "The job.", "content": _json("FineTuningJob")}, READ_STATUSES, []),
    ("post", "/v1/fine_tuning/jobs/{job_id}/cancel", FINE_TUNING, "Cancel a fine-tuning job", "Stops a queued or "
     "running job (a 400 `job_not_cancellable` once it has finished).", "job_id", None,
     {"description": "The job, cancelled.", "content": _json("FineTuningJob")}, READ_STATUSES, []),
    ("get", "/v1/fine_tuning/jobs/{job_id}/events", FINE_TUNING, "List a job's events", "Messages and metrics (the "
     "training curve), newest first.", "job_id", None,
     {"description": "A page of events.", "content": _json("FineTuningJobEventList")}, READ_STATUSES, PAGE),
    ("get", "/v1/fine_tuning/jobs/{job_id}/checkpoints", FINE_TUNING, "List a job's checkpoints", "Checkpoints "
     "saved during training, with their metrics, newest first.", "job_id", None,
     {"description": "A page of checkpoints.", "content": _json("FineTuningJobCheckpointList")}, READ_STATUSES,
     PAGE),
]  # fmt: skip


CHECK = obj({"ok": boolean(), "detail": text("What was found, in words (never an address).")}, ("ok", "detail"))
HEALTH = obj({
    "status": text(enum=["ok", "unavailable"]),
    "failed": array(text(enum=["database", "redis", "engines"]), "The checks that failed (empty with 200)."),
    "checks": obj({"database": CHECK, "redis": CHECK, "engines": CHECK}, ("database", "redis", "engines"),
                  closed=True),
}, ("status", "failed", "checks"), closed=True)  # fmt: skip
HEALTH_DESCRIPTION = (
    "For load balancers and load tools (guidellm asks it first); no key. 200 when this gateway reaches its "
    "database, Redis (where configured: `redis` passes when it is not) and at least one routable engine that "
    "answers its own health check; 503 otherwise, `failed` naming each check that failed. Each check waits at most "
    "2 s. `HEAD` answers the same status without a body."
)


def _add_health(result: dict) -> None:
    answer = {"description": "Every check passed.", "content": _json("GatewayHealth")}
    unavailable = {"description": "A check failed: `failed` names it.", "content": _json("GatewayHealth")}
    for path in ("/health", "/v1/health"):
        result["paths"].setdefault(path, {})["get"] = {
            "operationId": "gateway_health" if path == "/health" else "openai_get_v1_health",
            "tags": [INFERENCE], "summary": "Check the gateway's health", "description": HEALTH_DESCRIPTION,
            "security": [], "responses": {"200": answer, "503": unavailable},
        }  # fmt: skip


def add_v1_paths(result: dict) -> None:
    """Puts the /v1 operations and their component schemas into a generated schema."""
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    clashes = SCHEMAS.keys() & schemas.keys()
    assert not clashes, f"/v1 schema names already used by the management API: {sorted(clashes)}"
    schemas.update(SCHEMAS)
    for method, path, tag, summary, description, parameter, body, answer, statuses, query in OPERATIONS:
        inference = tag == INFERENCE
        operation = {
            "operationId": f"openai_{method}_{path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}",
            "tags": [tag], "summary": summary, "description": f"{description}\n\n{AUTH}",
            "security": [{"bearerAuth": []}],
            "responses": {"200": answer, **errors.error_responses(statuses, request_id=inference)},
        }  # fmt: skip
        parameters = [{"in": "path", "name": parameter, "required": True, "schema": text()}] if parameter else []
        if parameters or query:
            operation["parameters"] = [*parameters, *query]
        if body is not None:
            operation["requestBody"] = {"required": True, "content": body}
        result["paths"].setdefault(path, {})[method] = operation
    schemas["GatewayHealth"] = HEALTH
    _add_health(result)
    schemes = result["components"].setdefault("securitySchemes", {})
    schemes.setdefault("bearerAuth", {"type": "http", "scheme": "bearer"})
