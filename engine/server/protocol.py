"""The internal API's request bodies, parsed and validated before anything reaches the engine."""

import dataclasses
import json
import math
import re
import types
import typing
import uuid
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import SamplingParams

DIGEST = re.compile(r"^[0-9a-f]{64}$")
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@+=-]{1,100}$")
SAMPLING_FIELDS = {f.name: f.type for f in dataclasses.fields(SamplingParams)}
MAX_METADATA_BYTES = 4096
MAX_PROMPTS = 32  # a batch of prompts in one request
CONTEXT_OVERFLOW = ("cap", "refuse")  # a prompt plus max_tokens past the context: end at the context, or a 400


class BadRequest(ValueError):
    """A client mistake: answered with 400 and this message, before anything is scheduled."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code  # for the client to act on, e.g. engine.contract.CONTEXT_LENGTH_EXCEEDED


@dataclass(frozen=True)
class AdapterRef:
    digest: str
    path: str | None  # None: look in the engine's adapter store


@dataclass(frozen=True)
class PromptSpec:
    """Exactly one of: text, token ids, chat messages."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None


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
    metadata: dict[str, Any]  # the caller's, echoed in the usage event
    context_overflow: str = "cap"  # "refuse": a prompt plus max_tokens past the context is a 400 (OpenAI's way)

    @property
    def prompt(self) -> PromptSpec:
        """The request's one prompt (a batch has several: `prompts`)."""
        (prompt,) = self.prompts
        return prompt


GENERATE_FIELDS = {"request_id", "tenant", "weight", "api_key_id", "adapter", "prompt", "prompt_token_ids",
                   "messages", "sampling", "stream", "metadata", "context_overflow"}
TOKENIZE_FIELDS = {"prompt", "prompt_token_ids", "messages"}


def parse_generate(body: Any) -> GenerateRequest:
    body = _object(body, GENERATE_FIELDS, what="request body")
    request_id = body.get("request_id") or uuid.uuid4().hex
    if not isinstance(request_id, str) or not REQUEST_ID.match(request_id):
        raise BadRequest("request_id must be 1-100 characters of letters, digits and ._:@+=-", param="request_id")
    tenant = body.get("tenant", "default")
    if not isinstance(tenant, str) or not tenant:
        raise BadRequest("tenant must be a non-empty string", param="tenant")
    weight = body.get("weight", 1.0)
    if not _is_number(weight) or not 0 < weight < math.inf:
        raise BadRequest("weight must be a number > 0", param="weight")
    api_key_id = body.get("api_key_id")
    if api_key_id is not None and not isinstance(api_key_id, str):
        raise BadRequest("api_key_id must be a string or null", param="api_key_id")
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", param="stream")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or len(json.dumps(metadata)) > MAX_METADATA_BYTES:
        raise BadRequest(f"metadata must be a JSON object of at most {MAX_METADATA_BYTES} bytes", param="metadata")
    overflow = body.get("context_overflow", "cap")
    if overflow not in CONTEXT_OVERFLOW:
        raise BadRequest(f"context_overflow must be one of {list(CONTEXT_OVERFLOW)}", param="context_overflow")
    return GenerateRequest(
        request_id=request_id, tenant=tenant, weight=float(weight), api_key_id=api_key_id,
        adapter=parse_adapter(body.get("adapter")), prompts=parse_prompts(body),
        sampling=parse_sampling(body.get("sampling", {})), stream=stream, metadata=metadata,
        context_overflow=overflow,
    )


def parse_tokenize(body: Any) -> PromptSpec:
    return parse_prompt(_object(body, TOKENIZE_FIELDS, what="request body"))


def parse_adapter(value: Any) -> AdapterRef | None:
    """null, a digest, or {"digest": ..., "path": ...} (path: where the adapter is stored)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = {"digest": value}
    value = _object(value, {"digest", "path"}, what="adapter")
    digest, path = value.get("digest"), value.get("path")
    if not isinstance(digest, str) or not DIGEST.match(digest):
        raise BadRequest("adapter.digest must be a sha256 hex digest (64 lowercase hex characters)",
                         param="adapter.digest")
    if path is not None and (not isinstance(path, str) or not path):
        raise BadRequest("adapter.path must be a non-empty string", param="adapter.path")
    return AdapterRef(digest=digest, path=path)


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
        if not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
            raise BadRequest("prompt_token_ids must be a non-empty list of non-negative integers",
                             param="prompt_token_ids")
        return PromptSpec(token_ids=ids)
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise BadRequest(f"messages[{i}] must be an object with string role and content", param="messages")
    return PromptSpec(messages=messages)


def parse_sampling(value: Any) -> SamplingParams:
    value = _object(value, set(SAMPLING_FIELDS), what="sampling", noun="sampling parameter")
    for name, given in value.items():
        if not _matches(given, SAMPLING_FIELDS[name]):
            raise BadRequest(f"sampling.{name} has the wrong type: {given!r}", param=f"sampling.{name}")
    try:
        return SamplingParams(**value)
    except ValueError as error:
        raise BadRequest(f"sampling: {error}", param="sampling") from error


def _object(value: Any, allowed: set[str], *, what: str, noun: str = "field") -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest(f"{what} must be a JSON object")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise BadRequest(f"unknown {noun} {unknown[0]!r} in {what}; expected one of {sorted(allowed)}",
                         param=unknown[0])
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _matches(value: Any, annotation: Any) -> bool:
    """Whether a JSON value fits a SamplingParams field's annotation (int, float, bool, list[X], X | None)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arm) for arm in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(annotation)
        if item is str and isinstance(value, str):  # stop: "x" is shorthand for ["x"]
            return True
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return _is_int(value)
    if annotation is float:
        return _is_number(value)
    if annotation is str:
        return isinstance(value, str)
    raise TypeError(f"unhandled sampling annotation {annotation!r}")
