"""Parsing OpenAI chat and completion bodies into one validated generation request. Anything we don't serve
is refused by name with a 400, never silently ignored."""

import json
from dataclasses import dataclass, field

from gateway.errors import invalid
from gateway.request_guard import body_check

MAX_STOP_SEQUENCES = 4
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_PROMPTS = 32  # a batch of prompts on /v1/completions (the engine's bound)
MAX_CHOICES = 64  # a batch's prompts times n: the completions one request may hold in the engine at once

_COMMON = {
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
    "presence_penalty", "frequency_penalty", "user", "logit_bias",
}  # fmt: skip
CHAT_FIELDS = _COMMON | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice",
    "functions", "function_call", "parallel_tool_calls", "audio", "modalities", "prediction", "metadata", "store",
    "service_tier", "reasoning_effort", "web_search_options",
}  # fmt: skip
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
UNSUPPORTED = {
    "tools": "Tool calling is not supported by this server.",
    "tool_choice": "Tool calling is not supported by this server.",
    "functions": "Function calling is not supported by this server.",
    "function_call": "Function calling is not supported by this server.",
    "parallel_tool_calls": "Tool calling is not supported by this server.",
    "audio": "Audio output is not supported by this server.",
    "prediction": "Predicted outputs are not supported by this server.",
    "web_search_options": "Web search is not supported by this server.",
    "reasoning_effort": "Reasoning effort is not supported by this server's models.",
    "suffix": "`suffix` (insertion) is not supported by this server.",
}
MESSAGE_ROLES = {"system", "developer", "user", "assistant"}


@dataclass
class GenerationRequest:
    kind: str  # "chat" | "completion"
    model: str
    messages: list[dict] | None
    prompts: list[str | list[int]] | None  # completions: one prompt or a batch, each text or token ids
    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: the plan's default
    sampling: dict = field(default_factory=dict)  # n, temperature, top_p, stop, seed, penalties, logprobs
    logprobs: bool = False
    user: str | None = None
    echo: bool = False  # completions: each choice's text starts with the prompt
    max_tokens_given: bool = False  # the client named max_tokens: past the context it is refused, not capped

    @property
    def n(self) -> int:
        return self.sampling.get("n", 1)

    @property
    def num_choices(self) -> int:
        """n for each prompt of a batch."""
        return self.n * (len(self.prompts) if self.prompts is not None else 1)

    def prompt_bytes(self) -> int:
        """The prompt's text in bytes (token-id prompts count none: prompt_token_count has them)."""
        if self.prompts is not None:
            return sum(len(prompt.encode()) for prompt in self.prompts if isinstance(prompt, str))
        return sum(len(message["content"].encode()) for message in self.messages)

    def prompt_token_count(self) -> int:
        """The tokens of token-id prompts: counted exactly, without a tokenizer."""
        return sum(len(prompt) for prompt in self.prompts or [] if isinstance(prompt, list))


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError) as error:
        raise invalid(f"The request body is not valid JSON: {error}.") from None
    except RecursionError:
        raise invalid("The request body is nested too deeply.") from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    body_check(body)
    return body


def _number(body: dict, name: str, *, low: float, high: float, integer: bool = False):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise invalid(f"'{name}' must be {'an integer' if integer else 'a number'}.", param=name)
    if not low <= value <= high:
        raise invalid(f"{value} is not a valid value for '{name}': it must be between {low} and {high}.", param=name)
    return value


def _common(body: dict, allowed: set[str]) -> dict:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(f"Unrecognized request argument supplied: {', '.join(unknown)}.", param=unknown[0])
    for name, message in UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}):
            raise invalid(message, param=name, code="unsupported_parameter")
    if body.get("logit_bias"):
        raise invalid("`logit_bias` is not supported by this server.", param="logit_bias", code="unsupported_parameter")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise invalid("You must provide a model parameter.", param="model")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise invalid("'stream' must be a boolean.", param="stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise invalid("The 'stream_options' parameter is only allowed when 'stream' is enabled.", param="stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}):
        raise invalid("'stream_options' accepts only 'include_usage'.", param="stream_options")
    sampling: dict = {}
    for name, low, high in (("temperature", 0, 2), ("top_p", 0, 1), ("presence_penalty", -2, 2), ("frequency_penalty", -2, 2)):
        value = _number(body, name, low=low, high=high)
        if value is not None:
            sampling[name] = float(value)
    if sampling.get("top_p") == 0:  # the nucleus of p = 0 is the likeliest token alone
        del sampling["top_p"]
        sampling["top_k"] = 1
    n = _number(body, "n", low=1, high=MAX_N, integer=True)
    if n is not None:
        sampling["n"] = n
    seed = _number(body, "seed", low=-(2**63), high=2**63 - 1, integer=True)
    if seed is not None:
        sampling["seed"] = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP_SEQUENCES:
            raise invalid(f"'stop' must be a non-empty string or a list of up to {MAX_STOP_SEQUENCES} of them.", param="stop")
        if stop:
            sampling["stop"] = stop
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("'user' must be a string.", param="user")
    return {
        "model": body["model"], "stream": stream, "include_usage": bool(options and options.get("include_usage")),
        "sampling": sampling, "user": user,
    }  # fmt: skip


def _message(index: int, message) -> dict:
    param = f"messages.[{index}]"
    if not isinstance(message, dict):
        raise invalid(f"{param} must be an object with a role and content.", param=param)
    if message.get("role") not in MESSAGE_ROLES | {"tool", "function"}:
        raise invalid(f"{param}.role must be one of system, developer, user or assistant.", param=f"{param}.role",
                      code="invalid_value")  # fmt: skip
    if message["role"] in ("tool", "function"):
        raise invalid("Tool and function messages are not supported by this server.", param=param, code="unsupported_parameter")
    if message.get("tool_calls"):
        raise invalid("Tool calls are not supported by this server.", param=param, code="unsupported_parameter")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise invalid(f"Content parts of type '{kind}' (images, audio, files) are not supported; only text.",
                              param=f"{param}.content", code="unsupported_parameter")  # fmt: skip
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise invalid(f"{param}.content must be a string or a list of text parts.", param=f"{param}.content")
    role = "system" if message["role"] == "developer" else message["role"]
    return {"role": role, "content": content}


def parse_chat(body: dict) -> GenerationRequest:
    common = _common(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list.", param="messages")
    format_ = body.get("response_format")
    if format_ not in (None, {"type": "text"}):
        raise invalid("Only response_format {'type': 'text'} is supported.", param="response_format", code="unsupported_parameter")
    modalities = body.get("modalities")
    if modalities not in (None, ["text"]):
        raise invalid("Only the 'text' modality is supported.", param="modalities", code="unsupported_parameter")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid("'metadata' must be an object.", param="metadata")
    max_tokens = _number(body, "max_completion_tokens", low=1, high=2**31, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", low=1, high=2**31, integer=True)
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise invalid("'logprobs' must be a boolean.", param="logprobs")
    top = _number(body, "top_logprobs", low=0, high=MAX_TOP_LOGPROBS, integer=True)
    if top is not None and not logprobs:
        raise invalid("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
    if logprobs:
        common["sampling"]["logprobs"] = top or 0
    return GenerationRequest(
        kind="chat", messages=[_message(i, m) for i, m in enumerate(messages)], prompts=None,
        max_tokens=max_tokens, logprobs=logprobs, max_tokens_given=max_tokens is not None, **common,
    )  # fmt: skip


def _token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in value
    )


def _prompts(prompt) -> list[str | list[int]]:
    """OpenAI's four shapes: a string, a list of strings (a batch), a list of token ids, a list of such lists."""
    if isinstance(prompt, str):
        return [prompt]
    if _token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(_token_ids(p) for p in prompt)):  # fmt: skip
        if len(prompt) > MAX_PROMPTS:
            raise invalid(f"A batch holds at most {MAX_PROMPTS} prompts; this one has {len(prompt)}.", param="prompt")
        return list(prompt)
    raise invalid("'prompt' must be a string, a list of strings, a non-empty list of token ids (non-negative "
                  "integers) or a list of such lists.", param="prompt")  # fmt: skip


def parse_completion(body: dict) -> GenerationRequest:
    common = _common(body, COMPLETION_FIELDS)
    prompts = _prompts(body.get("prompt"))
    n = common["sampling"].get("n", 1)
    if len(prompts) * n > MAX_CHOICES:
        raise invalid(f"{len(prompts)} prompts with n={n} ask for {len(prompts) * n} completions; one request holds "
                      f"at most {MAX_CHOICES}.", param="n")  # fmt: skip
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise invalid("'echo' must be a boolean.", param="echo")
    best_of = body.get("best_of")
    if best_of not in (None, 1, common["sampling"].get("n", 1)):
        raise invalid("`best_of` other than n is not supported by this server.", param="best_of", code="unsupported_parameter")
    logprobs = _number(body, "logprobs", low=0, high=MAX_COMPLETION_LOGPROBS, integer=True)
    if logprobs is not None:
        common["sampling"]["logprobs"] = logprobs
    if echo and logprobs is not None:
        common["sampling"]["prompt_logprobs"] = logprobs
    max_tokens = _number(body, "max_tokens", low=1, high=2**31, integer=True)
    return GenerationRequest(
        kind="completion", messages=None, prompts=prompts, max_tokens=16 if max_tokens is None else max_tokens,
        logprobs=logprobs is not None, echo=echo, max_tokens_given=max_tokens is not None, **common,
    )  # fmt: skip
