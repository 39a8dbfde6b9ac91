"""Parsing OpenAI chat and completion bodies into one validated generation request. Anything we don't serve
is refused by name with a 400, never silently ignored."""

import json
import math
from dataclasses import dataclass, field

from gateway.chat_structure import structure as chat_structure
from gateway.errors import invalid
from gateway.hot_settings import hot
from gateway.request_guard import raw_body_check

MAX_STOP_SEQUENCES = 4
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_PROMPTS = 32  # a batch of prompts on /v1/completions (the engine's bound)
MAX_CHOICES = 64  # a batch's prompts times n: the completions one request may hold in the engine at once
MAX_LOGIT_BIAS = 300  # token ids in one logit_bias (OpenAI's bound)
MAX_STOP_TOKEN_IDS = 1024

# vLLM's sampling extensions, which load tools send (guidellm, `vllm bench serve`, aiperf, genai-perf); vLLM and SGLang
# accept them on both endpoints
EXTENSIONS = frozenset({"ignore_eos", "min_tokens", "top_k", "min_p", "repetition_penalty", "stop_token_ids"})
_COMMON = frozenset({
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
    "presence_penalty", "frequency_penalty", "user", "logit_bias",
}) | EXTENSIONS  # fmt: skip
CHAT_FIELDS = _COMMON | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice",
    "functions", "function_call", "parallel_tool_calls", "audio", "modalities", "prediction", "metadata", "store",
    "service_tier", "reasoning_effort", "web_search_options",
}  # fmt: skip
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
UNSUPPORTED = {
    "functions": "The deprecated `functions` are not supported by this server; use `tools`.",
    "function_call": "The deprecated `function_call` is not supported by this server; use `tool_choice`.",
    "audio": "Audio output is not supported by this server.",
    "prediction": "Predicted outputs are not supported by this server.",
    "web_search_options": "Web search is not supported by this server.",
    "reasoning_effort": "Reasoning effort is not supported by this server's models.",
    "suffix": "`suffix` (insertion) is not supported by this server.",
}
STREAM_OPTIONS = ("include_usage", "include_obfuscation", "continuous_usage_stats")  # OpenAI's two, then vLLM's
IMAGE_DETAILS = ("auto", "low", "high")  # OpenAI's; each image is read at the size the model's processor makes it
MESSAGE_ROLES = {"system", "developer", "user", "assistant"}
_SAMPLING = (("temperature", 0, 2), ("top_p", 0, 1), ("presence_penalty", -2, 2), ("frequency_penalty", -2, 2))
_SAMPLING_ORDER = tuple(name for name, _, _ in _SAMPLING)  # checked in this order
_SAMPLING_BOUNDS = {name: (low, high) for name, low, high in _SAMPLING}
_SAMPLING_NAMES = frozenset([*_SAMPLING_ORDER, "n", "seed"])
_RARE = frozenset({"stop", "user", "logit_bias"})  # checked only when the body names one
_ROLES = MESSAGE_ROLES | {"tool", "function"}
assert MAX_N <= MAX_CHOICES  # one prompt with any valid n fits in a request


@dataclass
class GenerationRequest:
    kind: str  # "chat" | "completion"
    model: str
    messages: list[dict] | None
    prompts: list[str | list[int]] | None  # completions: one prompt or a batch, each text or token ids
    stream: bool
    include_usage: bool  # stream_options.include_usage: a usage chunk before [DONE]
    max_tokens: int | None  # None: the plan's default
    sampling: dict = field(default_factory=dict)  # n, temperature, top_p, stop, seed, penalties, logprobs
    logprobs: bool = False
    user: str | None = None
    echo: bool = False  # completions: each choice's text starts with the prompt
    max_tokens_given: bool = False  # the client named max_tokens: past the context it is refused, not capped
    structure: dict = field(default_factory=dict)  # chat: response_format, tools, tool_choice, parallel_tool_calls
    continuous_usage: bool = False  # vLLM's continuous_usage_stats, with include_usage: each chunk's running usage
    image_params: list[str] = field(default_factory=list)  # chat: where each image part is, in order
    image_tokens: list[int] = field(default_factory=list)  # each image's prompt tokens (gateway.request_images)
    # (placeholder, expansion): where the model's processor writes text around each image (Gemma 3), the template's
    # placeholder and the text the engine puts in its place (engine.images' prompt_text); None: one token repeated
    image_text: tuple[str, str] | None = None

    @property
    def n(self) -> int:
        return self.sampling.get("n", 1)

    @property
    def num_choices(self) -> int:
        """n for each prompt of a batch."""
        return self.sampling.get("n", 1) * (len(self.prompts) if self.prompts is not None else 1)

    def prompt_bytes(self) -> int:
        """The prompt's text in bytes (token-id prompts count none: prompt_token_count has them)."""
        if self.prompts is not None:  # in C: no comprehension's frame
            return sum(map(len, map(str.encode, filter(str.__instancecheck__, self.prompts))))
        tools = len(json.dumps(self.structure["tools"]).encode()) if self.structure.get("tools") else 0
        return tools + sum([len(_text(message.get("content")).encode()) + _tool_calls_chars(message)
                            for message in self.messages])  # fmt: skip

    def prompt_token_count(self) -> int:
        """The tokens of token-id prompts: counted exactly, without a tokenizer."""
        if self.prompts is None:
            return 0
        return sum(map(len, filter(list.__instancecheck__, self.prompts)))


def _text(content: str | list[dict] | None) -> str:
    """A message's text: its content, or its text parts joined (an image part has none)."""
    if content.__class__ is str:
        return content
    return "".join(part["text"] for part in content if part["type"] == "text") if content else ""


def _tool_calls_chars(message: dict) -> int:
    """len(json.dumps(message.get("tool_calls", ""))): 2 (`""`) for the message without tool calls."""
    return len(json.dumps(message["tool_calls"])) if "tool_calls" in message else 2


# json.loads' own decoder settings, made once; its `raw_decode` reads one value from the start of a text
_decoder = json.JSONDecoder()


def _object_at_once(raw: bytes) -> dict | None:
    """json.loads(raw) for the common body: bytes that json.loads reads as UTF-8 (the first is "{" and the second
    not NUL: no BOM, not UTF-16/32), one object from the first byte to the last. None for anything else (or an
    error), which parse_body leaves to json.loads (its answer, or its error)."""
    if raw[:1] != b"{" or raw[1:2] == b"\x00":
        return None
    try:
        text = raw.decode("utf-8", "surrogatepass")  # as json.loads decodes bytes
        body, end = _decoder.raw_decode(text)
    except (ValueError, RecursionError):
        return None
    return body if end == len(text) else None


def parse_body(raw: bytes) -> dict:
    body = _object_at_once(raw)
    if body is not None:
        raw_body_check(raw, body)
        return body
    try:
        body = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError) as error:
        raise invalid(f"The request body is not valid JSON: {error}.") from None
    except RecursionError:
        raise invalid("The request body is nested too deeply.") from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    raw_body_check(raw, body)
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


def _count(body: dict, name: str, *, low: int, high: int) -> int | None:
    """`_number(..., integer=True)` with the common answer (a plain int in range, or none) found without its call."""
    value = body.get(name)
    if value is None or value.__class__ is int and low <= value <= high:
        return value
    return _number(body, name, low=low, high=high, integer=True)  # its error, or an int subclass's own value


def _common(body: dict, allowed: frozenset[str]) -> tuple[str, bool, int, dict, str | None]:
    """The fields both kinds share, checked in this order (the first error is the one answered): unknown names,
    unsupported ones, model, stream, stream_options, sampling, the extensions, stop, user, logit_bias. Returns
    (model, stream, usage, sampling, user), usage 0 (no usage chunk), 1 (include_usage) or 2 (with continuous
    usage as well)."""
    if not allowed.issuperset(body):
        unknown = sorted(set(body) - allowed)
        raise invalid(f"Unrecognized request argument supplied: {', '.join(unknown)}.", param=unknown[0])
    if not UNSUPPORTED.keys().isdisjoint(body):
        for name, message in UNSUPPORTED.items():
            if body.get(name) not in (None, [], {}):
                raise invalid(message, param=name, code="unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("You must provide a model parameter.", param="model")
    stream = body.get("stream") or False
    if stream is not True and stream is not False:
        raise invalid("'stream' must be a boolean.", param="stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise invalid("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                          param="stream_options")  # fmt: skip
        _stream_options(options)
    sampling: dict = {}
    if not _SAMPLING_NAMES.isdisjoint(body):  # most bodies set none of them, or one
        for name in _SAMPLING_ORDER:
            if name in body and (value := body[name]) is not None:
                low, high = _SAMPLING_BOUNDS[name]
                if value.__class__ is not float and value.__class__ is not int or not low <= value <= high:
                    value = _number(body, name, low=low, high=high)  # its error, or a subclass's own value
                sampling[name] = float(value)
        if "top_p" in sampling and sampling["top_p"] == 0:  # the nucleus of p = 0 is the likeliest token alone
            del sampling["top_p"]
            sampling["top_k"] = 1
        if "n" in body and (n := _count(body, "n", low=1, high=MAX_N)) is not None:
            sampling["n"] = n
        if "seed" in body and (seed := _count(body, "seed", low=-(2**63), high=2**63 - 1)) is not None:
            sampling["seed"] = seed
    if not EXTENSIONS.isdisjoint(body):
        _extensions(body, sampling)
    usage = 0 if not options or not options.get("include_usage") else 2 if options.get("continuous_usage_stats") else 1
    if _RARE.isdisjoint(body):  # no stop, user or logit_bias
        return model, stream, usage, sampling, None
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
    bias = _logit_bias(body["logit_bias"]) if "logit_bias" in body else None
    if bias:
        sampling["logit_bias"] = bias
    return model, stream, usage, sampling, user


def _stream_options(options) -> None:
    """OpenAI's stream_options, with vLLM's continuous_usage_stats; every key a boolean (or null)."""
    accepted = "'include_usage', 'include_obfuscation' and 'continuous_usage_stats'"
    if not isinstance(options, dict):
        raise invalid(f"'stream_options' must be an object; it accepts {accepted}.", param="stream_options")
    for name, value in options.items():
        if name not in STREAM_OPTIONS:
            raise invalid(f"Unrecognized key in 'stream_options': {name!r}. It accepts {accepted}.",
                          param="stream_options")  # fmt: skip
        if value is not None and not isinstance(value, bool):
            raise invalid(f"'stream_options.{name}' must be a boolean.", param=f"stream_options.{name}")


def _extensions(body: dict, sampling: dict) -> None:
    """vLLM's extensions, as vLLM reads them: null is the default; top_k 0 or -1 is off, and top_p 0 (top_k 1)
    stays the likeliest token alone. Defaults are not sent to the engine."""
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise invalid("'ignore_eos' must be a boolean.", param="ignore_eos")
    if ignore_eos:
        sampling["ignore_eos"] = True
    min_tokens = _number(body, "min_tokens", low=0, high=2**31, integer=True)
    if min_tokens:
        sampling["min_tokens"] = min_tokens
    top_k = _number(body, "top_k", low=-1, high=2**31, integer=True)
    if top_k is not None and top_k > 0:
        sampling["top_k"] = min(top_k, sampling.get("top_k", top_k))
    min_p = _number(body, "min_p", low=0, high=1)
    if min_p:
        sampling["min_p"] = float(min_p)
    penalty = body.get("repetition_penalty")
    if penalty is not None:
        if isinstance(penalty, bool) or not isinstance(penalty, int | float) or not 0 < penalty < math.inf:
            raise invalid(f"{penalty!r} is not a valid value for 'repetition_penalty': it must be a number greater "
                          f"than 0 (1 is none).", param="repetition_penalty")  # fmt: skip
        if penalty != 1:
            sampling["repetition_penalty"] = float(penalty)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOP_TOKEN_IDS or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in stop_ids):  # fmt: skip
            raise invalid(f"'stop_token_ids' must be a list of up to {MAX_STOP_TOKEN_IDS} token ids (non-negative "
                          f"integers).", param="stop_token_ids")  # fmt: skip
        if stop_ids:
            sampling["stop_token_ids"] = list(stop_ids)


def _logit_bias(value) -> dict[str, float]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}; ids past the model's vocabulary are the engine's 400."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise invalid(f"'logit_bias' must be an object mapping up to {MAX_LOGIT_BIAS} token ids to biases in "
                      f"[-100, 100].", param="logit_bias")  # fmt: skip
    for token, bias in value.items():
        if not (token.isascii() and token.isdigit()) or int(token) >= 2**31:
            raise invalid(f"Invalid key in 'logit_bias': {token!r} is not a token id.", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise invalid(f"Invalid value in 'logit_bias' for token {token}: {bias!r} must be a number between -100 "
                          f"and 100.", param="logit_bias")  # fmt: skip
    return {token: float(bias) for token, bias in value.items()}


def _tool_call(param: str, call) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not isinstance(function.get("arguments"), str) or not isinstance(call.get("id"), str):
        raise invalid(f"{param} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}} with "
                      f"string values.", param=param)  # fmt: skip
    return {"id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": function["arguments"]}}


def _message(index: int, message) -> dict:
    if not isinstance(message, dict):
        raise invalid(f"messages.[{index}] must be an object with a role and content.", param=f"messages.[{index}]")
    role = message.get("role")
    if role not in _ROLES:
        raise invalid(f"messages.[{index}].role must be one of system, developer, user, assistant or tool.",
                      param=f"messages.[{index}].role", code="invalid_value")  # fmt: skip
    if role == "function":
        raise invalid("The deprecated function messages are not supported; answer tool calls with role 'tool'.",
                      param=f"messages.[{index}]", code="unsupported_parameter")  # fmt: skip
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise invalid(f"messages.[{index}].tool_calls must be a list, on an assistant message.",
                          param=f"messages.[{index}].tool_calls")  # fmt: skip
        calls = [_tool_call(f"messages.[{index}].tool_calls.[{i}]", call) for i, call in enumerate(calls)]
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise invalid(f"messages.[{index}].tool_call_id must name the tool call this message answers.",
                      param=f"messages.[{index}].tool_call_id")  # fmt: skip
    content = message.get("content")
    if content.__class__ is str:  # the common message: no parts to join
        pass
    elif content is None and calls:
        return {"role": "assistant", "content": None, "tool_calls": calls}
    elif isinstance(content, list):
        content = _content_parts(index, role, content)
    elif not isinstance(content, str):
        raise invalid(f"messages.[{index}].content must be a string or a list of text parts.",
                      param=f"messages.[{index}].content")  # fmt: skip
    if role == "tool":
        return {"role": "tool", "content": content, "tool_call_id": message["tool_call_id"]}
    if calls:
        return {"role": role, "content": content, "tool_calls": calls}
    return {"role": "system" if role == "developer" else role, "content": content}


def _content_parts(index: int, role: str, content: list) -> str | list[dict]:
    """Text parts joined into one string; with an image among them (a user's message), the parts as the chat
    template reads them: {"type": "text", "text"} and {"type": "image_url", "image_url": {"url"[, "detail"]}}."""
    parts, images = [], False
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        param = f"messages.[{index}].content.[{j}]"
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            if role != "user":
                raise invalid(f"Image content parts are only allowed in user messages; messages.[{index}] is a "
                              f"{role} message.", param=param)  # fmt: skip
            parts.append(_image_part(param, part))
            images = True
        else:
            raise invalid(f"Content parts of type '{kind}' (audio, files) are not supported; only text and "
                          f"image_url.", param=param, code="unsupported_parameter")  # fmt: skip
    return parts if images else "".join(part["text"] for part in parts)


def _image_part(param: str, part: dict) -> dict:
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else None
    if not isinstance(url, str) or not url:
        raise invalid(f"{param}.image_url must be an object with a 'url' (a data:image/...;base64,... URL).",
                      param=param)  # fmt: skip
    detail = image_url.get("detail")
    if detail is not None and detail not in IMAGE_DETAILS:
        raise invalid(f"{param}.image_url.detail must be one of 'auto', 'low' or 'high'.", param=param,
                      code="invalid_value")  # fmt: skip
    return {"type": "image_url", "image_url": {"url": url} | ({"detail": detail} if detail else {})}


def _image_params(messages: list[dict]) -> list[str]:
    """Where each image part of parsed messages is, in order ("messages.[0].content.[1]")."""
    return [f"messages.[{i}].content.[{j}]" for i, message in enumerate(messages)
            if message["content"].__class__ is list
            for j, part in enumerate(message["content"]) if part["type"] == "image_url"]  # fmt: skip


_CHAT_RARE = frozenset({"modalities", "metadata", "logprobs", "top_logprobs"})  # checked when the body names one


def parse_chat(body: dict) -> GenerationRequest:
    model, stream, usage, sampling, user = _common(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list.", param="messages")
    structure = chat_structure(body)
    logprobs = False
    if not _CHAT_RARE.isdisjoint(body):
        modalities = body.get("modalities")
        if modalities not in (None, ["text"]):
            raise invalid("Only the 'text' modality is supported.", param="modalities", code="unsupported_parameter")
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise invalid("'metadata' must be an object.", param="metadata")
    max_tokens = _count(body, "max_completion_tokens", low=1, high=2**31)
    if max_tokens is None:
        max_tokens = _count(body, "max_tokens", low=1, high=2**31)
    if not _CHAT_RARE.isdisjoint(body):
        logprobs = body.get("logprobs") or False
        if not isinstance(logprobs, bool):
            raise invalid("'logprobs' must be a boolean.", param="logprobs")
        top = _number(body, "top_logprobs", low=0, high=MAX_TOP_LOGPROBS, integer=True) if "top_logprobs" in body else None
        if top is not None and not logprobs:
            raise invalid("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
        if logprobs:
            sampling["logprobs"] = top or 0
    if "min_tokens" in sampling:
        _min_tokens_fit(sampling["min_tokens"], max_tokens)
    parsed = [_message(i, m) for i, m in enumerate(messages)]
    images = _image_params(parsed) if any(m["content"].__class__ is list for m in parsed) else []
    if len(images) > hot.QUILT_IMAGES_PER_REQUEST:
        raise invalid(f"A request may carry at most {hot.QUILT_IMAGES_PER_REQUEST} images; this one has {len(images)}.",
                      param=images[hot.QUILT_IMAGES_PER_REQUEST], code="too_many_images")  # fmt: skip
    return GenerationRequest(
        kind="chat", model=model, messages=parsed, prompts=None,
        stream=stream, include_usage=usage > 0, max_tokens=max_tokens, sampling=sampling, logprobs=logprobs,
        user=user, max_tokens_given=max_tokens is not None, structure=structure, continuous_usage=usage == 2,
        image_params=images,
    )  # fmt: skip


def _min_tokens_fit(min_tokens: int, max_tokens: int | None) -> None:
    """min_tokens no more than the max_tokens the client named (the plan's default is admission's to check)."""
    if max_tokens is not None and min_tokens > max_tokens:
        raise invalid(f"'min_tokens' ({min_tokens}) must be less than or equal to 'max_tokens' ({max_tokens}).",
                      param="min_tokens")  # fmt: skip


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


_COMPLETION_RARE = frozenset({"echo", "best_of", "logprobs"})  # checked when the body names one


def parse_completion(body: dict) -> GenerationRequest:
    model, stream, usage, sampling, user = _common(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if prompt.__class__ is str:  # one text prompt: any valid n fits (MAX_N <= MAX_CHOICES)
        prompts = [prompt]
    else:
        prompts = _prompts(prompt)
        n = sampling.get("n", 1)
        if len(prompts) * n > MAX_CHOICES:
            raise invalid(f"{len(prompts)} prompts with n={n} ask for {len(prompts) * n} completions; one request "
                          f"holds at most {MAX_CHOICES}.", param="n")  # fmt: skip
    echo = False
    logprobs = None
    if not _COMPLETION_RARE.isdisjoint(body):
        echo = body.get("echo") or False
        if not isinstance(echo, bool):
            raise invalid("'echo' must be a boolean.", param="echo")
        best_of = body.get("best_of")
        if best_of not in (None, 1, sampling.get("n", 1)):
            raise invalid("`best_of` other than n is not supported by this server.", param="best_of",
                          code="unsupported_parameter")  # fmt: skip
        if body.get("logprobs") is not None:
            logprobs = sampling["logprobs"] = _number(body, "logprobs", low=0, high=MAX_COMPLETION_LOGPROBS, integer=True)
            if echo:
                sampling["prompt_logprobs"] = logprobs
    max_tokens = body.get("max_tokens")  # `_count(body, "max_tokens", ...)` without its call
    if max_tokens is not None and (max_tokens.__class__ is not int or not 1 <= max_tokens <= 2**31):
        max_tokens = _number(body, "max_tokens", low=1, high=2**31, integer=True)
    if "min_tokens" in sampling:
        _min_tokens_fit(sampling["min_tokens"], 16 if max_tokens is None else max_tokens)
    return GenerationRequest(
        kind="completion", model=model, messages=None, prompts=prompts, stream=stream, include_usage=usage > 0,
        max_tokens=16 if max_tokens is None else max_tokens, sampling=sampling, logprobs=logprobs is not None,
        user=user, echo=echo, max_tokens_given=max_tokens is not None, continuous_usage=usage == 2,
    )  # fmt: skip
