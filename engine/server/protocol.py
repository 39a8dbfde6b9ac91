"""The internal API's request bodies, parsed and validated before anything reaches the engine."""

import dataclasses
import json
import re
import types
import typing
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from adapters.layout import WEIGHTS_NAME
from adapters.loaded import SIDECAR_NAME
from engine.contract import VERSION, UsageMetadata, WrongVersion
from engine.contract import generate as wire
from engine.contract.generate import ADAPTER_FILES, DIGEST_PATTERN, AdapterRef
from engine.contract.version import version_of
from engine.sampling_params import SamplingParams
from engine.server.body_checks import BadRequest, is_int, is_number, object_fields
from engine.server.kv_protocol import KVTransfer, kv_transfer_of

FETCHED_FILES = ADAPTER_FILES  # what the engine reads of a canonical adapter
assert set(FETCHED_FILES) == {SIDECAR_NAME, WEIGHTS_NAME}, FETCHED_FILES
SAMPLING_FIELDS = {f.name: f.type for f in dataclasses.fields(SamplingParams)}
MAX_PROMPTS = 32  # a batch of prompts in one request
IMAGE_DETAILS = ("auto", "low", "high")  # OpenAI's; accepted, and each image is read at the processor's size
CONTEXT_OVERFLOW = ("cap", "refuse")  # a prompt plus max_tokens past the context: end at the context, or a 400


@dataclass(frozen=True)
class PromptSpec:
    """Exactly one of: text, token ids, chat messages."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict] | None = None  # role, content (str, or null beside tool_calls), tool_calls, tool_call_id


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    tenant: str
    weight: float
    api_key_id: str | None
    adapter: AdapterRef | None
    prompts: tuple[PromptSpec, ...]  # one, or a batch: each prompt gets n completions, indexed prompt * n + i
    sampling: SamplingParams
    stream: bool
    metadata: UsageMetadata  # the gateway's, echoed in the usage event
    context_overflow: str = "cap"  # "refuse": a prompt plus max_tokens past the context is a 400 (OpenAI's way)
    response_format: dict | None = None  # OpenAI's: {"type": "json_object"} or {"type": "json_schema", ...}
    tools: list[dict] | None = None  # OpenAI's function tools: [{"type": "function", "function": {...}}]
    tool_choice: str | dict | None = None  # "none", "auto", "required" or {"type": "function", "function": {name}}
    parallel_tool_calls: bool = True
    kv_transfer: KVTransfer | None = None

    @property
    def prompt(self) -> PromptSpec:
        """The request's one prompt (a batch has several: `prompts`)."""
        (prompt,) = self.prompts
        return prompt


FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
TOKENIZE_FIELDS = {"prompt", "prompt_token_ids", "messages"}
_decode_generate = msgspec.json.Decoder(wire.GenerateRequest).decode
# What a field the struct refuses is answered, where a client reads more from a sentence than from the struct's
# words: field path -> (message, the param it names).
DIGEST = re.compile(DIGEST_PATTERN)  # a path parameter's digest, checked as the struct checks the body's
FIELD_MESSAGES = {
    "": ("request body must be a JSON object", None),
    "request_id": ("request_id must be 1-100 characters of letters, digits and ._:@+=-", "request_id"),
    "tenant": ("tenant must be a non-empty string", "tenant"),
    "weight": ("weight must be a number > 0", "weight"),
    "api_key_id": ("api_key_id must be a string or null", "api_key_id"),
    "stream": ("stream must be true or false", "stream"),
    "metadata": ("metadata must be a JSON object", "metadata"),
    "parallel_tool_calls": ("parallel_tool_calls must be true or false", "parallel_tool_calls"),
    "context_overflow": (f"context_overflow must be one of {list(CONTEXT_OVERFLOW)}", "context_overflow"),
    "adapter": ("adapter.digest must be a sha256 hex digest (64 lowercase hex characters)", "adapter.digest"),
    "adapter.digest": ("adapter.digest must be a sha256 hex digest (64 lowercase hex characters)", "adapter.digest"),
    "adapter.path": ("adapter.path must be a non-empty string", "adapter.path"),
    "adapter.urls": (f"adapter.urls must map {' and '.join(FETCHED_FILES)} to http(s) URLs", "adapter.urls"),
    "kv_transfer": ("kv_transfer must be {'mode': 'prefill', 'lease_ttl_s'?} or {'mode': 'decode', 'lease': {...}}",
                    "kv_transfer.mode"),
    "kv_transfer.mode": ("kv_transfer must be {'mode': 'prefill', 'lease_ttl_s'?} or {'mode': 'decode', 'lease': "
                         "{...}}", "kv_transfer.mode"),
}  # fmt: skip
_AT = re.compile(r"^(?P<text>.*?)(?: - at `\$(?P<path>.*)`)?$", re.DOTALL)
_NAMED = re.compile(r"^Object (?P<how>missing required|contains unknown) field `(?P<name>[^`]*)`$")


def refusal(error: msgspec.ValidationError, *, under: str = "") -> BadRequest:
    """The 400 of a field the struct refused, naming it by its path (`kv_transfer.lease.id`), from `under`."""
    parts = _AT.match(str(error))
    text, path = parts["text"], under + (parts["path"] or "")
    path = path.removeprefix(".")
    named = _NAMED.match(text)
    if named is not None:
        path = f"{path}.{named['name']}" if path else named["name"]
        if named["how"] == "contains unknown":
            return BadRequest(f"unknown field {path!r}", param=path)
    known = path if path in FIELD_MESSAGES else path.partition("[")[0]  # adapter.urls[...]: the map's
    if known in FIELD_MESSAGES:
        message, param = FIELD_MESSAGES[known]
        return BadRequest(message, param=param)
    return BadRequest(f"{path}: {text}", param=path)


def parse_generate(body: bytes) -> GenerateRequest:
    """The generate request's bytes, decoded by the contract's struct (a field it refuses is a 400 naming its
    path; a request of another version, a 400 naming the version), then its prompt, sampling and structured-output
    fields, which the struct leaves to this server."""
    try:
        request = _decode_generate(body)
    except msgspec.ValidationError as error:
        version = version_of(body)
        if version != VERSION:
            raise BadRequest(str(WrongVersion("generate request", version)), param="v") from None
        refused = refusal(error)
        if refused.param is not None and refused.param.startswith(LOOSE_FIELDS):
            _loose_fields(json_strict(body))  # a number JSON allows and no field can hold: named in their words
        raise refused from None
    except msgspec.DecodeError:
        json_strict(body)  # names what is not JSON (NaN, a truncated body)
        raise BadRequest("the request body is not valid JSON") from None
    stream = request.stream
    prompts = parse_prompts({"prompt": request.prompt, "prompt_token_ids": request.prompt_token_ids,
                             "messages": request.messages})  # fmt: skip
    kv_transfer = kv_transfer_of(request.kv_transfer)
    if kv_transfer is not None and len(prompts) > 1:
        raise BadRequest("kv_transfer takes one prompt, not a batch", param="kv_transfer")
    if kv_transfer is not None and kv_transfer.mode == "prefill" and stream:
        raise BadRequest("kv_transfer mode 'prefill' answers one JSON object: set stream to false",
                         param="kv_transfer.mode")
    tools = parse_tools(request.tools)
    return GenerateRequest(
        request_id=request.request_id or uuid.uuid4().hex, tenant=request.tenant, weight=request.weight,
        api_key_id=request.api_key_id, adapter=parse_adapter(request.adapter), prompts=prompts,
        sampling=parse_sampling(request.sampling), stream=stream, metadata=request.metadata,
        response_format=parse_response_format(request.response_format), tools=tools,
        tool_choice=parse_tool_choice(request.tool_choice, tools), parallel_tool_calls=request.parallel_tool_calls,
        context_overflow=request.context_overflow, kv_transfer=kv_transfer,
    )  # fmt: skip


LOOSE_FIELDS = ("prompt", "prompt_token_ids", "messages", "sampling", "response_format", "tools", "tool_choice")


def _loose_fields(body: dict) -> None:
    """The fields the struct leaves to this server, read from the body as Python's json reads it."""
    parse_prompts({name: body.get(name) for name in TOKENIZE_FIELDS})
    parse_sampling(body.get("sampling", {}))
    parse_response_format(body.get("response_format"))
    parse_tool_choice(body.get("tool_choice"), parse_tools(body.get("tools")))


def json_strict(body: bytes) -> object:
    """The body as JSON, or a 400 saying why it is not (Python's json reads NaN and Infinity, which JSON has not)."""
    try:
        return json.loads(body, parse_constant=_not_json)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise BadRequest(f"the request body is not valid JSON: {error}") from error
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None


def _not_json(name: str):
    """Python's json reads NaN and Infinity, which JSON has not (a NaN temperature samples garbage)."""
    raise BadRequest(f"the request body is not valid JSON: {name} is not a JSON number")


def parse_response_format(value: Any) -> dict | None:
    """None for plain text; else {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name",
    "schema", ...}} (the schema itself is checked when it compiles)."""
    if value is None or value == {"type": "text"}:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequest("response_format must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                         param="response_format")
    if value["type"] == "json_object":
        return {"type": "json_object"}
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not FUNCTION_NAME.match(spec["name"]):
        raise BadRequest("response_format.json_schema must be an object with a name of 1-64 letters, digits, _ "
                         "or -", param="response_format.json_schema")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise BadRequest("response_format.json_schema.schema must be a JSON schema object",
                         param="response_format.json_schema.schema")
    return {"type": "json_schema", "json_schema": {"name": spec["name"], "schema": schema}}


def parse_tools(value: Any) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise BadRequest("tools must be a non-empty list of function tools", param="tools")
    tools, names = [], set()
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param=f"tools[{i}]")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise BadRequest(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -",
                             param=f"tools[{i}].function.name")
        if name in names:
            raise BadRequest(f"tools[{i}].function.name {name!r} is given twice", param=f"tools[{i}].function.name")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object",
                             param=f"tools[{i}].function.parameters")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise BadRequest(f"tools[{i}].function.description must be a string",
                             param=f"tools[{i}].function.description")
        kept = {"name": name} | ({"description": description} if description else {}) \
            | ({"parameters": parameters} if parameters is not None else {})
        tools.append({"type": "function", "function": kept})
    return tools


def parse_tool_choice(value: Any, tools: list[dict] | None) -> str | dict | None:
    if value is None:
        return None if tools is None else "auto"
    if isinstance(value, dict):
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if value.get("type") != "function" or not isinstance(name, str):
            raise BadRequest("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                             "{'name': ...}}", param="tool_choice")
        if not any(t["function"]["name"] == name for t in tools or []):
            raise BadRequest(f"tool_choice names the function {name!r}, which is not in tools", param="tool_choice")
        return {"type": "function", "function": {"name": name}}
    if value not in ("none", "auto", "required"):
        raise BadRequest("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                         "{'name': ...}}", param="tool_choice")
    if value != "none" and tools is None:
        raise BadRequest(f"tool_choice {value!r} needs tools", param="tool_choice")
    return value


def parse_tokenize(body: Any) -> PromptSpec:
    return parse_prompt(object_fields(body, TOKENIZE_FIELDS, what="request body"))


def parse_adapter(value: str | dict | AdapterRef | None) -> AdapterRef | None:
    """null, a digest, or {"digest", "path"?, "urls"?} (path: where the adapter is stored; urls: each file of its
    canonical form, FETCHED_FILES, by a signed GET URL, for an engine that shares no disk with it)."""
    try:
        ref = msgspec.convert(value, str | AdapterRef | None)
    except msgspec.ValidationError as error:
        raise refusal(error, under="adapter") from None
    if isinstance(ref, str):
        if not DIGEST.match(ref):
            raise BadRequest(FIELD_MESSAGES["adapter"][0], param="adapter.digest")
        ref = AdapterRef(digest=ref)
    if ref is None or ref.urls is None:
        return ref
    if set(ref.urls) != set(FETCHED_FILES) or not all(url.startswith(("https://", "http://"))
                                                      for url in ref.urls.values()):  # fmt: skip
        raise BadRequest(f"adapter.urls must map {' and '.join(FETCHED_FILES)} to http(s) URLs", param="adapter.urls")
    if ref.path is not None:
        raise BadRequest("give adapter.path or adapter.urls, not both", param="adapter.urls")
    return ref


def parse_prompts(body: dict[str, Any]) -> tuple[PromptSpec, ...]:
    """One prompt, or a batch: `prompt` as a list of strings, `prompt_token_ids` as a list of lists."""
    for name in ("prompt", "prompt_token_ids"):
        batch = body.get(name)
        if isinstance(batch, list) and batch and all(isinstance(item, list | str) for item in batch):
            if not 1 <= len(batch) <= MAX_PROMPTS:
                raise BadRequest(f"a batch holds 1 to {MAX_PROMPTS} prompts, not {len(batch)}", param=name)
            return tuple(parse_prompt({**body, name: item}) for item in batch)
    return (parse_prompt(body),)


def parse_prompt(body: dict[str, Any]) -> PromptSpec:
    given = [name for name in ("prompt", "prompt_token_ids", "messages") if body.get(name) is not None]
    if len(given) != 1:
        raise BadRequest("give exactly one of prompt, prompt_token_ids or messages", param="prompt")
    if given == ["prompt"]:
        if not isinstance(body["prompt"], str) or not body["prompt"]:
            raise BadRequest("prompt must be a non-empty string", param="prompt")
        return PromptSpec(text=body["prompt"])
    if given == ["prompt_token_ids"]:
        ids = body["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or not all(is_int(t) and t >= 0 for t in ids):
            raise BadRequest("prompt_token_ids must be a non-empty list of non-negative integers",
                             param="prompt_token_ids")
        return PromptSpec(token_ids=ids)
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with string role and content", param="messages")
        calls = message.get("tool_calls")
        if calls is not None and (message["role"] != "assistant" or not _tool_calls_valid(calls)):
            raise BadRequest(f"messages[{i}].tool_calls must be an assistant's list of {{'id', 'type': 'function', "
                             f"'function': {{'name', 'arguments'}}}}", param="messages")
        content = message.get("content")
        if isinstance(content, list):
            _content_parts(i, content)
        elif not isinstance(content, str) and not (content is None and calls):
            raise BadRequest(f"messages[{i}] must be an object with string role and content", param="messages")
        if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise BadRequest(f"messages[{i}] (a tool result) needs the tool_call_id it answers", param="messages")
    return PromptSpec(messages=messages)


def _content_parts(index: int, parts: list) -> None:
    """OpenAI's content parts: {"type": "text", "text"} and {"type": "image_url", "image_url": {"url", "detail"}}
    (the image itself is checked as it is decoded)."""
    if not parts:
        raise BadRequest(f"messages[{index}].content must not be an empty list", param=f"messages[{index}].content")
    for j, part in enumerate(parts):
        param = f"messages.[{index}].content.[{j}]"  # as OpenAI names a content part
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        image_url = part.get("image_url") if kind == "image_url" else None
        if isinstance(image_url, dict) and isinstance(image_url.get("url"), str) \
                and image_url.get("detail", "auto") in IMAGE_DETAILS:
            continue
        raise BadRequest(f"{param} must be {{'type': 'text', 'text': ...}} or {{'type': 'image_url', 'image_url': "
                         f"{{'url': 'data:image/...;base64,...', 'detail': 'auto' | 'low' | 'high'}}}}", param=param)


def _tool_calls_valid(calls: Any) -> bool:
    return isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments"), str | dict) for c in calls)


def parse_sampling(value: Any) -> SamplingParams:
    value = dict(object_fields(value, set(SAMPLING_FIELDS), what="sampling", noun="sampling parameter"))
    if value.get("logit_bias") is not None:
        value["logit_bias"] = parse_logit_bias(value["logit_bias"])
    for name, given in value.items():
        if not _matches(given, SAMPLING_FIELDS[name]):
            raise BadRequest(f"sampling.{name} has the wrong type: {given!r}", param=f"sampling.{name}")
    try:
        return SamplingParams(**value)
    except ValueError as error:
        raise BadRequest(f"sampling: {error}", param="sampling") from error


def parse_logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's logit_bias: {"token id": bias}, the ids as JSON object keys (strings of digits)."""
    if not isinstance(value, dict):
        raise BadRequest("sampling.logit_bias must be an object mapping token ids to biases in [-100, 100]",
                         param="sampling.logit_bias")
    bias = {}
    for key, number in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()) and not is_int(key):
            raise BadRequest(f"sampling.logit_bias keys must be token ids, got {key!r}", param="sampling.logit_bias")
        if not is_number(number) or not -100 <= number <= 100:
            raise BadRequest(f"sampling.logit_bias[{key}] must be a number in [-100, 100], got {number!r}",
                             param="sampling.logit_bias")
        bias[int(key)] = float(number)
    return bias


def _matches(value: Any, annotation: Any) -> bool:
    """Whether a JSON value fits a SamplingParams field's annotation (int, float, bool, list[X], X | None)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arm) for arm in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin is dict:  # logit_bias, already parsed (parse_logit_bias)
        return isinstance(value, dict)
    if origin is list:
        (item,) = typing.get_args(annotation)
        if item is str and isinstance(value, str):  # stop: "x" is shorthand for ["x"]
            return True
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return is_int(value)
    if annotation is float:
        return is_number(value)
    if annotation is str:
        return isinstance(value, str)
    raise TypeError(f"unhandled sampling annotation {annotation!r}")
