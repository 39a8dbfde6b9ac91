"""POST /v1/chat/completions: the request (messages, tools, tool_choice, response_format, logprobs) as
gateway.openai_request.parse_chat takes it, and the answer as gateway.openai_response builds it, whole or streamed."""

from quilt.openai_schema.generation import CHUNK_USAGE, FINISH_REASON, RUNNING_USAGE, USAGE, common_properties
from quilt.openai_schema.shapes import (
    UNIX_TIME,
    array,
    boolean,
    const,
    integer,
    nullable,
    number,
    obj,
    ref,
    text,
)

NAME_PATTERN = "^[A-Za-z0-9_-]{1,64}$"

TEXT_PART = obj({"type": const("text"), "text": text()}, ("type", "text"),
                description="Audio and file parts are refused (`unsupported_parameter`); images only in user messages.")
CONTENT = {"oneOf": [text(), array(ref("ChatTextPart"))],
           "description": "A string, or a list of text parts (joined into one string)."}
IMAGE_PART = obj({
    "type": const("image_url"),
    "image_url": obj({
        "url": text("A data URL, `data:image/png;base64,...` (png, jpeg or webp). An http(s) URL is refused "
                    "(`image_url_not_allowed`) unless the deployment fetches images from allowlisted hosts."),
        "detail": {"type": "string", "enum": ["auto", "low", "high"],
                   "description": "Accepted; the image is read at the size the model's processor makes it."},
    }, ("url",)),
}, ("type", "image_url"), description="An image, for a vision-language base model (a text-only one answers 400 "
                                      "`image_input_not_supported`). Its tokens are prompt tokens. A corrupt, "
                                      "unsupported, oversized or surplus image is a 400 (`invalid_image`, "
                                      "`too_many_images`) whose `param` names the part.")  # fmt: skip
USER_CONTENT = {"oneOf": [text(), array({"oneOf": [ref("ChatTextPart"), ref("ChatImagePart")]})],
                "description": "A string, or a list of text and image parts (text alone is joined into one string)."}


def _message(role: dict, *, extra: dict | None = None, required: tuple[str, ...] = ("role", "content"),
             content: dict | None = None, description: str = "") -> dict:
    return obj({"role": role, "content": content or ref("ChatContent"),
                "name": text("Accepted and ignored."), **(extra or {})}, required, description=description)


TOOL_CALL = obj({
    "id": text("The call's id; a `tool` message answers it by this id."),
    "type": const("function"),
    "function": obj({"name": text(), "arguments": text("The arguments as a JSON text, as the model wrote them: "
                                                       "parse it, and check it against the function's `parameters`.")},
                    ("name", "arguments")),
}, ("id", "type", "function"))
TOOL_CALL["example"] = {"id": "call_8f2a", "type": "function",
                        "function": {"name": "get_weather", "arguments": "{\"city\": \"oslo\"}"}}
MESSAGES = {
    "ChatSystemMessage": _message(const("system"), description="Instructions (the model's chat template places them)."),
    "ChatDeveloperMessage": _message(const("developer"), description="Taken as a system message."),
    "ChatUserMessage": _message(const("user"), content=ref("ChatUserContent")),
    "ChatAssistantMessage": {
        **_message(const("assistant"), content={**nullable(ref("ChatContent")),
                                                "description": "Null only beside `tool_calls`."},
                   extra={"tool_calls": array(ref("ChatToolCall"), minItems=1)}, required=("role",),
                   description="An earlier answer: its text, its tool calls, or both."),
        "anyOf": [{"required": ["content"], "properties": {"content": ref("ChatContent")}}, {"required": ["tool_calls"]}],
    },
    "ChatToolMessage": _message(const("tool"), extra={"tool_call_id": text("The `id` of the call this answers.")},
                                required=("role", "content", "tool_call_id"),
                                description="A tool's result, answering one of the assistant's tool calls."),
}  # fmt: skip
MESSAGE = {
    "oneOf": [ref(name) for name in MESSAGES],
    "discriminator": {"propertyName": "role", "mapping": {
        "system": "#/components/schemas/ChatSystemMessage", "developer": "#/components/schemas/ChatDeveloperMessage",
        "user": "#/components/schemas/ChatUserMessage", "assistant": "#/components/schemas/ChatAssistantMessage",
        "tool": "#/components/schemas/ChatToolMessage"}},
    "description": "One turn. The deprecated `function` role is refused (`unsupported_parameter`).",
}  # fmt: skip

TOOL = obj({
    "type": const("function"),
    "function": obj({
        "name": text("Unique among the tools.", pattern=NAME_PATTERN),
        "description": text("What the function does, for the model."),
        "parameters": {"type": "object", "description": "A JSON schema of the arguments (an object). Generation is "
                       "constrained to it: the arguments the model writes are valid JSON that matches it."},
        "strict": nullable(boolean("Accepted; arguments always match `parameters`.")),
    }, ("name",)),
}, ("type", "function"), description="A function the model may call. Only `function` tools are served.")
TOOL_CHOICE = {
    "oneOf": [
        text(enum=["none", "auto", "required"]),
        obj({"type": const("function"), "function": obj({"name": text()}, ("name",))}, ("type", "function")),
    ],
    "description": "`auto` (the default): the model answers in text or calls tools; `none`: text only; `required`: "
                   "at least one tool call; `{\"type\": \"function\", \"function\": {\"name\": ...}}`: that function, "
                   "which must be in `tools`. Only with `tools` (otherwise a 400).",
}  # fmt: skip
RESPONSE_FORMAT = {
    "oneOf": [
        obj({"type": const("text")}, ("type",), closed=True),
        obj({"type": const("json_object")}, ("type",), description="Any JSON object."),
        obj({"type": const("json_schema"), "json_schema": obj({
            "name": text(pattern=NAME_PATTERN),
            "description": text("Accepted and ignored."),
            "schema": {"type": "object", "description": "The JSON schema the answer must match (`{}`: any JSON). A "
                       "schema the engine can't compile is a 400 with `param: response_format.json_schema.schema`."},
            "strict": nullable(boolean("Accepted; the answer always matches the schema.")),
        }, ("name",))}, ("type", "json_schema")),
    ],
    "description": "Constrains generation: the answer's `content` is a JSON text (an object for `json_object`, one "
                   "matching `json_schema.schema` otherwise), unless `max_tokens` cut it short "
                   "(`finish_reason: length`).",
}  # fmt: skip

REQUEST = obj({
    **common_properties(n_description="Choices to generate for the prompt.",
                        prompt={"messages": array(ref("ChatMessage"), minItems=1)}),
    "max_completion_tokens": nullable(integer("OpenAI's newer name for `max_tokens`; wins when both are given.",
                                              minimum=1, maximum=2**31)),
    "logprobs": nullable(boolean("Return each generated token's log probability.", default=False)),
    "top_logprobs": nullable(integer("With `logprobs`: also the likeliest alternatives at each position.",
                                     minimum=0, maximum=20)),
    "response_format": nullable(ref("ChatResponseFormat")),
    "tools": nullable(array(ref("ChatTool"), minItems=1, maxItems=128)),
    "tool_choice": nullable(ref("ChatToolChoice")),
    "parallel_tool_calls": nullable(boolean("Whether the model may make several calls in one answer (default: "
                                            "true). Only with `tools`.")),
    "modalities": nullable(array(text(enum=["text"]), minItems=1, maxItems=1, description="Only `[\"text\"]`.")),
    "metadata": nullable({"type": "object", "description": "Accepted and ignored."}),
    "store": nullable(boolean("Accepted and ignored: bodies are kept as the tenant's retention setting says.")),
    "service_tier": nullable(text("Accepted and ignored.")),
}, ("model", "messages"), closed=True, description="Any other field is a 400 (`Unrecognized request argument "
                                                   "supplied`).")  # fmt: skip
REQUEST["example"] = {
    "model": "support-bot", "messages": [{"role": "system", "content": "Answer in one sentence."},
                                         {"role": "user", "content": "Where is order 1234?"}],
    "max_tokens": 64, "temperature": 0.2, "stream": True, "stream_options": {"include_usage": True},
}  # fmt: skip

TOKEN_LOGPROB = obj({
    "token": text(), "logprob": number(),
    "bytes": nullable(array(integer(minimum=0, maximum=255), description="The token's UTF-8 bytes.")),
}, ("token", "logprob", "bytes"))
LOGPROBS = obj({
    "content": array({"allOf": [ref("ChatTokenLogprob")], "type": "object", "properties": {
        "top_logprobs": array(ref("ChatTokenLogprob"), description="`top_logprobs` alternatives, likeliest first.")},
        "required": ["top_logprobs"]}, description="One entry per generated token."),
    "refusal": nullable(array(ref("ChatTokenLogprob"), description="Always null.")),
}, ("content", "refusal"))  # fmt: skip
COMPLETION = obj({
    "id": text("`chatcmpl-` followed by the request id (the `x-request-id` header).", pattern="^chatcmpl-"),
    "object": const("chat.completion"),
    "created": UNIX_TIME,
    "model": text("The `model` asked for."),
    "system_fingerprint": nullable(text("Always null.")),
    "choices": array(obj({
        "index": integer(minimum=0),
        "message": obj({
            "role": const("assistant"),
            "content": nullable(text("The answer; null when the answer is tool calls alone.")),
            "refusal": nullable(text("Always null.")),
            "tool_calls": array(ref("ChatToolCall"), minItems=1),
        }, ("role", "content", "refusal")),
        "logprobs": nullable(ref("ChatLogprobs")),
        "finish_reason": FINISH_REASON,
    }, ("index", "message", "logprobs", "finish_reason")), minItems=1),
    "usage": ref("CompletionUsage"),
}, ("id", "object", "created", "model", "system_fingerprint", "choices", "usage"))  # fmt: skip
COMPLETION["example"] = {
    "id": "chatcmpl-3b1f0c9e2d6a4c1e9a7b5d3f1e0c2a4b", "object": "chat.completion", "created": 1764300000,
    "model": "support-bot", "system_fingerprint": None,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Order 1234 ships tomorrow.", "refusal": None},
                 "logprobs": None, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 31, "completion_tokens": 7, "total_tokens": 38,
              "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": {"reasoning_tokens": 0}},
}  # fmt: skip

TOOL_CALL_DELTA = obj({
    "index": integer("Which call of the choice this part belongs to.", minimum=0),
    "id": text("In the call's first part only."),
    "type": const("function", "In the call's first part only."),
    "function": obj({"name": text("In the call's first part only."),
                     "arguments": text("A fragment of the arguments' JSON text: concatenate them in order.")}),
}, ("index",))  # fmt: skip
CHUNK = obj({
    "id": text(pattern="^chatcmpl-"),
    "object": const("chat.completion.chunk"),
    "created": UNIX_TIME,
    "model": text(),
    "system_fingerprint": nullable(text()),
    "choices": array(obj({
        "index": integer(minimum=0),
        "delta": obj({
            "role": const("assistant", "In each choice's first chunk only."),
            "content": nullable(text("The next piece of text (`\"\"` in a first chunk that carries none).")),
            "tool_calls": array(ref("ChatToolCallDelta"), description="A call's `id` and `name` (with `arguments: "
                                                                      "\"\"`), then fragments of its arguments."),
        }),
        "logprobs": nullable(ref("ChatLogprobs")),
        "finish_reason": nullable(FINISH_REASON),
    }, ("index", "delta", "logprobs", "finish_reason")), description="Empty in the usage chunk."),
    "usage": CHUNK_USAGE,
}, ("id", "object", "created", "model", "system_fingerprint", "choices"),
    description="One `data:` event of a streamed chat completion. A choice's last chunk has its `finish_reason`.")
CHUNK["example"] = {
    "id": "chatcmpl-3b1f0c9e2d6a4c1e9a7b5d3f1e0c2a4b", "object": "chat.completion.chunk", "created": 1764300000,
    "model": "support-bot", "system_fingerprint": None,
    "choices": [{"index": 0, "delta": {"content": "Order 1234"}, "logprobs": None, "finish_reason": None}],
    "usage": None,
}  # fmt: skip

SCHEMAS = {
    "ChatCompletionRequest": REQUEST, "ChatMessage": MESSAGE, **MESSAGES, "ChatContent": CONTENT,
    "ChatTextPart": TEXT_PART, "ChatUserContent": USER_CONTENT, "ChatImagePart": IMAGE_PART, "ChatToolCall": TOOL_CALL, "ChatTool": TOOL, "ChatToolChoice": TOOL_CHOICE,
    "ChatResponseFormat": RESPONSE_FORMAT, "ChatCompletion": COMPLETION, "ChatCompletionChunk": CHUNK,
    "ChatToolCallDelta": TOOL_CALL_DELTA, "ChatLogprobs": LOGPROBS, "ChatTokenLogprob": TOKEN_LOGPROB,
    "CompletionUsage": USAGE, "CompletionUsageSoFar": RUNNING_USAGE,
}  # fmt: skip
