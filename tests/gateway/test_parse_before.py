"""The parse's cheaper code gives what the code before it gave (issue 37, item 23): the same GenerationRequest, or
the same 400, for bodies that vary every numeric and sampling field over absent, null, valid, out of range and of
the wrong type; the same `prompt_bytes` and `prompt_token_count`; and `parse_body` the same object as json.loads.
The code before is kept below as it was, as the oracle."""

import itertools
import json
import random

import pytest

from gateway import openai_request as parse
from gateway.chat_structure import structure as chat_structure
from gateway.errors import ApiError, invalid
from gateway.openai_request import GenerationRequest, parse_body

# the code before (main at 0c41398), verbatim but for the module prefix


def _number_before(body: dict, name: str, *, low: float, high: float, integer: bool = False):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise invalid(f"'{name}' must be {'an integer' if integer else 'a number'}.", param=name)
    if not low <= value <= high:
        raise invalid(f"{value} is not a valid value for '{name}': it must be between {low} and {high}.", param=name)
    return value


def _common_before(body: dict, allowed: set[str]) -> dict:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(f"Unrecognized request argument supplied: {', '.join(unknown)}.", param=unknown[0])
    if not parse.UNSUPPORTED.keys().isdisjoint(body):
        for name, message in parse.UNSUPPORTED.items():
            if body.get(name) not in (None, [], {}):
                raise invalid(message, param=name, code="unsupported_parameter")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise invalid("You must provide a model parameter.", param="model")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise invalid("'stream' must be a boolean.", param="stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise invalid("The 'stream_options' parameter is only allowed when 'stream' is enabled.", param="stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}):
        # changed since, on purpose: the error names the key and lists every key accepted (vLLM's one included)
        raise invalid(f"Unrecognized key in 'stream_options': {sorted(options)[0]!r}. It accepts 'include_usage', "
                      f"'include_obfuscation' and 'continuous_usage_stats'.", param="stream_options")
    sampling: dict = {}
    if not parse._SAMPLING_NAMES.isdisjoint(body):
        for name, low, high in parse._SAMPLING:
            value = _number_before(body, name, low=low, high=high)
            if value is not None:
                sampling[name] = float(value)
        if sampling.get("top_p") == 0:
            del sampling["top_p"]
            sampling["top_k"] = 1
        n = _number_before(body, "n", low=1, high=parse.MAX_N, integer=True)
        if n is not None:
            sampling["n"] = n
        seed = _number_before(body, "seed", low=-(2**63), high=2**63 - 1, integer=True)
        if seed is not None:
            sampling["seed"] = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > parse.MAX_STOP_SEQUENCES:
            raise invalid(f"'stop' must be a non-empty string or a list of up to {parse.MAX_STOP_SEQUENCES} of them.", param="stop")
        if stop:
            sampling["stop"] = stop
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("'user' must be a string.", param="user")
    bias = parse._logit_bias(body["logit_bias"]) if "logit_bias" in body else None
    if bias:
        sampling["logit_bias"] = bias
    return {
        "model": body["model"], "stream": stream, "include_usage": bool(options and options.get("include_usage")),
        "sampling": sampling, "user": user,
    }  # fmt: skip


def _message_before(index: int, message) -> dict:
    param = f"messages.[{index}]"
    if not isinstance(message, dict):
        raise invalid(f"{param} must be an object with a role and content.", param=param)
    if message.get("role") not in parse.MESSAGE_ROLES | {"tool", "function"}:
        raise invalid(f"{param}.role must be one of system, developer, user, assistant or tool.", param=f"{param}.role",
                      code="invalid_value")  # fmt: skip
    if message["role"] == "function":
        raise invalid("The deprecated function messages are not supported; answer tool calls with role 'tool'.",
                      param=param, code="unsupported_parameter")  # fmt: skip
    calls = message.get("tool_calls")
    if calls is not None and (message["role"] != "assistant" or not isinstance(calls, list)):
        raise invalid(f"{param}.tool_calls must be a list, on an assistant message.", param=f"{param}.tool_calls")
    calls = [parse._tool_call(f"{param}.tool_calls.[{i}]", call) for i, call in enumerate(calls or [])]
    if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise invalid(f"{param}.tool_call_id must name the tool call this message answers.",
                      param=f"{param}.tool_call_id")  # fmt: skip
    content = message.get("content")
    if content is None and calls:
        return {"role": "assistant", "content": None, "tool_calls": calls}
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
    if role == "tool":
        return {"role": "tool", "content": content, "tool_call_id": message["tool_call_id"]}
    return {"role": role, "content": content} | ({"tool_calls": calls} if calls else {})


def parse_chat_before(body: dict) -> GenerationRequest:
    common = _common_before(body, set(parse.CHAT_FIELDS))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list.", param="messages")
    structure = chat_structure(body)
    modalities = body.get("modalities")
    if modalities not in (None, ["text"]):
        raise invalid("Only the 'text' modality is supported.", param="modalities", code="unsupported_parameter")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid("'metadata' must be an object.", param="metadata")
    max_tokens = _number_before(body, "max_completion_tokens", low=1, high=2**31, integer=True)
    if max_tokens is None:
        max_tokens = _number_before(body, "max_tokens", low=1, high=2**31, integer=True)
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise invalid("'logprobs' must be a boolean.", param="logprobs")
    top = _number_before(body, "top_logprobs", low=0, high=parse.MAX_TOP_LOGPROBS, integer=True)
    if top is not None and not logprobs:
        raise invalid("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
    if logprobs:
        common["sampling"]["logprobs"] = top or 0
    return GenerationRequest(
        kind="chat", messages=[_message_before(i, m) for i, m in enumerate(messages)], prompts=None,
        max_tokens=max_tokens, logprobs=logprobs, max_tokens_given=max_tokens is not None, structure=structure,
        **common,
    )  # fmt: skip


def parse_completion_before(body: dict) -> GenerationRequest:
    common = _common_before(body, set(parse.COMPLETION_FIELDS))
    prompts = parse._prompts(body.get("prompt"))
    n = common["sampling"].get("n", 1)
    if len(prompts) * n > parse.MAX_CHOICES:
        raise invalid(f"{len(prompts)} prompts with n={n} ask for {len(prompts) * n} completions; one request holds "
                      f"at most {parse.MAX_CHOICES}.", param="n")  # fmt: skip
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise invalid("'echo' must be a boolean.", param="echo")
    best_of = body.get("best_of")
    if best_of not in (None, 1, common["sampling"].get("n", 1)):
        raise invalid("`best_of` other than n is not supported by this server.", param="best_of", code="unsupported_parameter")
    logprobs = _number_before(body, "logprobs", low=0, high=parse.MAX_COMPLETION_LOGPROBS, integer=True)
    if logprobs is not None:
        common["sampling"]["logprobs"] = logprobs
    if echo and logprobs is not None:
        common["sampling"]["prompt_logprobs"] = logprobs
    max_tokens = _number_before(body, "max_tokens", low=1, high=2**31, integer=True)
    return GenerationRequest(
        kind="completion", messages=None, prompts=prompts, max_tokens=16 if max_tokens is None else max_tokens,
        logprobs=logprobs is not None, echo=echo, max_tokens_given=max_tokens is not None, **common,
    )  # fmt: skip


def prompt_bytes_before(request: GenerationRequest) -> int:
    if request.prompts is not None:
        return sum(len(prompt.encode()) for prompt in request.prompts if isinstance(prompt, str))
    tools = len(json.dumps(request.structure["tools"]).encode()) if request.structure.get("tools") else 0
    return tools + sum(len((message.get("content") or "").encode()) + len(json.dumps(message.get("tool_calls", "")))
                       for message in request.messages)  # fmt: skip


# the comparison

VALUES = [None, 0, 1, 2, 5, 17, 0.5, -1, 2.5, True, False, "1", [1], 2**63]
NUMERIC = ["temperature", "top_p", "presence_penalty", "frequency_penalty", "n", "seed", "max_tokens", "logprobs",
           "max_completion_tokens", "top_logprobs", "best_of"]  # fmt: skip
OTHERS = {"stream": [True, False, None, 1], "stream_options": [{"include_usage": True}, {"x": 1}, None],
          "echo": [True, False, 1], "stop": ["s", ["a", "b"], [], [""], 3], "user": ["u", 3],
          "logit_bias": [{"7": 1}, {"x": 1}, None, {}], "model": ["m", "", 3], "suffix": ["x", []],
          "extra_field": [1], "modalities": [["text"], ["audio"], None], "metadata": [{"a": "b"}, 3, None]}  # fmt: skip


def outcome(parser, body: dict):
    try:
        return parser(json.loads(json.dumps(body)))  # each parser its own copy: the parse may mutate nothing shared
    except ApiError as error:
        return (error.status, error.message, error.param, error.code)


def bodies(kind: str, count: int):
    rng = random.Random(f"{kind}-37")
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else \
        {"model": "m", "prompt": "p"}  # fmt: skip
    yield dict(base)
    for name, value in itertools.product(NUMERIC, VALUES):  # each field alone, every value
        yield base | {name: value}
    for _ in range(count):  # several at once: which error comes first
        body = dict(base)
        for name in rng.sample(NUMERIC, rng.randint(1, 5)):
            body[name] = rng.choice(VALUES)
        for name in rng.sample(sorted(OTHERS), rng.randint(0, 3)):
            body[name] = rng.choice(OTHERS[name])
        yield body


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_the_same_request_or_the_same_400_as_before(kind):
    new, old = (parse.parse_chat, parse_chat_before) if kind == "chat" else \
        (parse.parse_completion, parse_completion_before)  # fmt: skip
    outcomes = set()
    for body in bodies(kind, 3000):
        before = outcome(old, body)
        assert outcome(new, body) == before, body
        outcomes.add(type(before).__name__ if isinstance(before, GenerationRequest) else before[2])
    assert {"GenerationRequest", "n", "seed", "max_tokens", "temperature"} <= outcomes  # the bodies reach them


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
MESSAGE_SHAPES = [
    {"role": "user", "content": "hi"}, {"role": "developer", "content": "d"}, {"role": "system", "content": ""},
    {"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "assistant", "content": "x", "tool_calls": [CALL]},
    {"role": "assistant", "content": "x", "tool_calls": []}, {"role": "assistant", "content": None, "tool_calls": []},
    {"role": "assistant", "content": None}, {"role": "user", "content": None}, {"role": "user"},
    {"role": "user", "tool_calls": [CALL], "content": "x"}, {"role": "assistant", "tool_calls": "no"},
    {"role": "assistant", "tool_calls": [{"id": 1}]}, {"role": "assistant", "tool_calls": None, "content": "x"},
    {"role": "tool", "content": "r", "tool_call_id": "c1"}, {"role": "tool", "content": "r"},
    {"role": "tool", "content": None, "tool_call_id": "c1"}, {"role": "function", "content": "f"}, {"role": "robot"},
    {"content": "no role"}, {"role": None, "content": "x"}, {"role": ["user"], "content": "x"}, "not a dict", None, 3,
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    {"role": "user", "content": []}, {"role": "user", "content": 5}, {"role": "user", "content": {"text": "x"}},
    {"role": "developer", "content": [{"type": "text", "text": "a"}]},
    {"role": "tool", "content": [{"type": "text", "text": "a"}], "tool_call_id": "c"},
    {"role": "assistant", "content": [], "tool_calls": [CALL]}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
]  # fmt: skip  (a part other than text is refused by its own index, or is an image: tests/gateway/vlm)


def any_outcome(parser, body: dict):
    """`outcome`, with any other exception (an unhashable role's TypeError) as its type and text."""
    try:
        return outcome(parser, body)
    except Exception as error:  # noqa: BLE001 - compared, not hidden
        return (type(error).__name__, str(error))


def test_each_message_as_before():
    """Every shape of message alone, and in random lists of two to four (their indexes in the errors), gives the
    same messages or the same 400 as the code before."""
    rng = random.Random("messages-37")
    lists = [[shape] for shape in MESSAGE_SHAPES]
    lists += [rng.sample(MESSAGE_SHAPES, rng.randint(2, 4)) for _ in range(600)]
    seen = set()
    for messages in lists:
        body = {"model": "m", "messages": messages}
        before = any_outcome(parse_chat_before, body)
        assert any_outcome(parse.parse_chat, body) == before, messages
        seen.add(type(before).__name__ if isinstance(before, GenerationRequest) else before[0])
    assert {"GenerationRequest", 400, "TypeError"} <= seen


PROMPTS = ["p", ["a", "b\u00e9"], [1, 2, 3], [[1, 2], [3]], ["\U0001f600" * 3]]
MESSAGES = [
    [{"role": "user", "content": "caf\u00e9"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"}]}],
    [{"role": "user", "content": "q"},
     {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                            "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
     {"role": "tool", "content": "r", "tool_call_id": "c1"}],
]  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_completions_prompt_counts_as_before(prompt):
    request = parse.parse_completion({"model": "m", "prompt": prompt, "n": 2})
    assert request.prompt_bytes() == prompt_bytes_before(request)
    assert request.prompt_token_count() == sum(len(p) for p in request.prompts if isinstance(p, list))
    assert request.num_choices == 2 * len(request.prompts) and request.n == 2


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_a_chats_prompt_counts_as_before(messages, tools):
    request = parse.parse_chat({"model": "m", "messages": messages} | ({"tools": tools} if tools else {}))
    assert request.prompt_bytes() == prompt_bytes_before(request) > 0
    assert request.prompt_token_count() == 0 and request.num_choices == 1


JSON_BODIES = [
    b'{"model": "m", "prompt": "p"}', b' {"model": "m"}', b'{"model": "m"} ', b'{"model": "m"}\n',
    b'{"model": "m"} x', b'{"model": "m"}{}', b'{"model": "m", "a": 1e400, "b": NaN, "c": -Infinity}',
    b'{"a": 1, "a": 2, "model": "m"}', b'{"model": "caf\xc3\xa9", "x": "\\u00e9\\n"}', b'{"model": "\xff"}',
    b'{"model": "m", "x": "\xed\xa0\x80"}', b"{", b"{}", b"{\x00", b'{"model": 1}\x00',
    '{"model": "m"}'.encode("utf-16-le"), '{"model": "m"}'.encode("utf-8-sig"), b'{"model": "m", "x": [' + b"[" * 5000
    + b"]" * 5000 + b"]}", b'{"model": "m", "n": 01}', b'{"model": "m", "big": 123456789012345678901234567890}',
]  # fmt: skip


def decoded(decode, raw: bytes):
    try:
        return ("ok", decode(raw))
    except ApiError as error:
        return (error.status, error.message, error.param)


def loads_before(raw: bytes):
    """parse_body before: json.loads, then the same checks."""
    try:
        body = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError) as error:
        raise invalid(f"The request body is not valid JSON: {error}.") from None
    except RecursionError:
        raise invalid("The request body is nested too deeply.") from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    parse.raw_body_check(raw, body)
    return body


@pytest.mark.parametrize("raw", JSON_BODIES)
def test_parse_body_reads_what_json_loads_reads(raw):
    got, before = decoded(parse_body, raw), decoded(loads_before, raw)
    assert repr(got) == repr(before)  # repr: NaN is not equal to itself


def test_the_common_body_skips_json_loads(monkeypatch):
    monkeypatch.setattr(parse.json, "loads", None)  # a call would fail
    assert parse_body(b'{"model": "m", "prompt": "p", "stream": true}') == {"model": "m", "prompt": "p", "stream": True}
