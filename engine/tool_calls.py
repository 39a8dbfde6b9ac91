"""Tool calls in each model family's own convention: the grammar that makes a call parse by construction
(`tool_choice` "required" or a named function), and the parser that splits a completion's text into content and
calls. The format is picked once per model from its chat template (`format_for_template`), never per token.

    hermes       <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>     Qwen2/2.5/3, Hermes
    llama3_json  {"name": ..., "parameters": {...}}  (calls joined by "; ")       Llama 3.1+
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]            Mistral

`parse(text, final=False)` only reports what can no longer change: content that cannot be the start of a call,
and calls whose text is complete; so a stream can send the difference after each token (`ToolCallStream`)."""

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.grammar import JSON_OPTIONS


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}", compare=False)

    def as_json(self, index: int) -> dict:
        return {"index": index, "id": self.id, "name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: list[ToolCall]


def function_object(function: dict, *, arguments_key: str) -> dict:
    """The JSON schema of one call of `function` ({"name", "parameters"?}): its name, then its arguments."""
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}


def _calls_rule(functions: list[dict], *, arguments_key: str) -> str:
    """Lark rules `fn` (one call of any of `functions`) and one `%json` rule per function."""
    names = [f"fn_{i}" for i in range(len(functions))]
    rules = [f"fn: {' | '.join(names)}"]
    for name, function in zip(names, functions, strict=True):
        rules.append(inline_json(name, function_object(function, arguments_key=arguments_key)))
    return "\n".join(rules)


def inline_json(rule: str, schema: dict) -> str:
    """A Lark rule for a JSON value of `schema`, with the JSON options of a schema compiled alone (compact)."""
    return f"{rule}: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"


def _literal(text: str, special_id: Callable[[str], int | None]) -> str:
    """A Lark literal for a marker, or its token when the tokenizer has it as a special token (special tokens
    never match text)."""
    token = special_id(text)
    return f"<[{token}]>" if token is not None else json.dumps(text)


def _call(obj, *, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in arguments_keys:
        if key in obj:
            arguments = obj[key]
            if isinstance(arguments, str):  # some models write the arguments as a JSON string
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    return None
            return ToolCall(name=obj["name"], arguments=json.dumps(arguments, ensure_ascii=False))
    return ToolCall(name=obj["name"], arguments="{}")


def _held(text: str, marker: str) -> int:
    """How many characters at the end of text may be the start of marker (held back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class Hermes:
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    arguments_keys = ("arguments",)

    def matches(self, template: str) -> bool:
        return self.OPEN in template

    def grammar(self, functions: list[dict], *, parallel: bool, special_id: Callable[[str], int | None]) -> str:
        """Lark rules of `calls`: one call, or several with `parallel`, of any of `functions`."""
        call = f"call: {_literal(self.OPEN, special_id)} \"\\n\" fn \"\\n\" {_literal(self.CLOSE, special_id)}"
        calls = 'calls: call ("\\n" call)*' if parallel else "calls: call"
        return "\n".join([calls, call, _calls_rule(functions, arguments_key="arguments")])

    def parse(self, text: str, *, final: bool) -> Parsed:
        content, calls, pos = "", [], 0
        while True:
            at = text.find(self.OPEN, pos)
            if at < 0:
                tail = text[pos:]
                tail = tail if final else tail[: len(tail) - _held(tail, self.OPEN)]
                if not calls or tail.strip():  # whitespace between and after calls is no content
                    content += tail
                break
            if not calls or text[pos:at].strip():
                content += text[pos:at]
            end = text.find(self.CLOSE, at)
            body = text[at + len(self.OPEN) : end if end >= 0 else len(text)]
            if end < 0 and not final:
                break  # a call still being written
            call = _decoded_call(body, self.arguments_keys, raw=_raw_arguments(body))
            if call is None:  # not a call after all: the model's text, as written
                content += text[at : end + len(self.CLOSE) if end >= 0 else len(text)]
            else:
                calls.append(call)
            if end < 0:
                break
            pos = end + len(self.CLOSE)
        return Parsed(content=content, calls=calls)

    def open_call(self, text: str) -> tuple[str, str] | None:
        """The call being written at the end of text, once its name is known: (name, the arguments' text so far
        that can no longer change: not a closing brace, whitespace or the start of </tool_call> at the end)."""
        at = text.rfind(self.OPEN)
        if at < 0 or self.CLOSE in text[at:]:
            return None
        body = text[at + len(self.OPEN) :]
        head = NAME_FIRST.match(body)
        if head is None:
            return None
        arguments = body[head.end() :]
        arguments = arguments[: len(arguments) - _held(arguments, "\n" + self.CLOSE)]
        while arguments and arguments[-1] in "} \t\r\n":  # the arguments' last brace, or the call's
            arguments = arguments[:-1]
        return head.group(1), arguments


NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*')


def _raw_arguments(body: str) -> str | None:
    """The arguments as the model wrote them, for a call written name first: streamed fragments of them then add up
    to exactly what the whole call says."""
    head = NAME_FIRST.match(body)
    rest = body.rstrip()
    if head is None or not rest.endswith("}"):
        return None
    return rest[head.end() : -1].rstrip()


class Llama3Json:
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"
    arguments_keys = ("parameters", "arguments")

    def matches(self, template: str) -> bool:
        return self.PYTHON_TAG in template or ("ipython" in template and '"parameters"' in template)

    def grammar(self, functions: list[dict], *, parallel: bool, special_id: Callable[[str], int | None]) -> str:
        calls = 'calls: fn ("; " fn)*' if parallel else "calls: fn"
        return "\n".join([calls, _calls_rule(functions, arguments_key="parameters")])

    def parse(self, text: str, *, final: bool) -> Parsed:
        body = text.lstrip().removeprefix(self.PYTHON_TAG).lstrip()
        if not body:
            return Parsed(content=text if final else "", calls=[])
        if not body.startswith("{"):
            return Parsed(content=text, calls=[])
        if not final:
            return Parsed(content="", calls=[])  # a call being written (decided at the end)
        calls = _json_sequence(body, separator=";", arguments_keys=self.arguments_keys)
        return Parsed(content="", calls=calls) if calls else Parsed(content=text, calls=[])


class Mistral:
    name = "mistral"
    MARKER = "[TOOL_CALLS]"
    arguments_keys = ("arguments",)

    def matches(self, template: str) -> bool:
        return self.MARKER in template

    def grammar(self, functions: list[dict], *, parallel: bool, special_id: Callable[[str], int | None]) -> str:
        items = 'fn ("," " "? fn)*' if parallel else "fn"
        calls = f'calls: {_literal(self.MARKER, special_id)} "[" {items} "]"'
        return "\n".join([calls, _calls_rule(functions, arguments_key="arguments")])

    def parse(self, text: str, *, final: bool) -> Parsed:
        at = text.find(self.MARKER)
        if at < 0 and text.lstrip().startswith("[{"):  # the marker is a special token, skipped when decoding
            at = len(text) - len(text.lstrip()) - len(self.MARKER)
        elif at < 0:
            return Parsed(content=text if final else text[: len(text) - _held(text, self.MARKER)], calls=[])
        if not final:
            return Parsed(content=text[: max(at, 0)], calls=[])
        try:
            array, _ = json.JSONDecoder().raw_decode(text[at + len(self.MARKER) :].lstrip())
        except ValueError:
            array = None
        calls = [_call(obj, arguments_keys=self.arguments_keys) for obj in array] if isinstance(array, list) else []
        if not calls or None in calls:
            return Parsed(content=text, calls=[])
        return Parsed(content=text[: max(at, 0)], calls=calls)


ToolCallFormat = Hermes | Llama3Json | Mistral
FORMATS: tuple[ToolCallFormat, ...] = (Hermes(), Mistral(), Llama3Json())


def format_for_template(template: str | None) -> ToolCallFormat | None:
    """The convention a chat template teaches its model (None: the template knows no tools)."""
    if not template:
        return None
    return next((f for f in FORMATS if f.matches(template)), None)


def _decoded_call(body: str, arguments_keys: tuple[str, ...], *, raw: str | None = None) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    call = _call(obj, arguments_keys=arguments_keys)
    if call is not None and raw is not None and _same_json(raw, call.arguments):
        call = ToolCall(name=call.name, arguments=raw)
    return call


def _same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


def _json_sequence(text: str, *, separator: str, arguments_keys: tuple[str, ...]) -> list[ToolCall]:
    """Calls written as JSON objects one after another, separated by `separator` (empty if any is not one)."""
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return []
        call = _call(obj, arguments_keys=arguments_keys)
        if call is None:
            return []
        calls.append(call)
        rest = text[pos:].lstrip()
        if rest.startswith(separator):
            rest = rest[len(separator) :].lstrip()
        pos = len(text) - len(rest)
    return calls


class ToolCallStream:
    """One completion's text as it grows, split into content and calls: `push()` returns what is new since the last
    push: content text, and call deltas as OpenAI streams them ({"index", "id", "name", "arguments": ""} when a
    call's name is known, then {"index", "arguments": fragment} as its arguments grow, for formats that can tell
    (`open_call`); else each call whole once complete). Fragments of a call add up to its arguments."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.content_sent = 0
        self.calls: list[ToolCall] = []  # complete, with the ids they were sent with
        self.open: tuple[ToolCall, str] | None = None  # the call being streamed, and its arguments sent so far

    def push(self, text: str, *, final: bool) -> tuple[str, list[dict]]:
        parsed = self.fmt.parse(text, final=final)
        content = parsed.content[self.content_sent :]
        self.content_sent = max(self.content_sent, len(parsed.content))
        deltas = []
        for call in parsed.calls[len(self.calls) :]:
            index = len(self.calls)
            if self.open is not None:  # the call streamed so far is this one: the rest of its arguments
                opened, sent = self.open
                self.open = None
                call = ToolCall(name=call.name, arguments=call.arguments, id=opened.id)
                if call.arguments.startswith(sent) and call.arguments != sent:
                    deltas.append({"index": index, "arguments": call.arguments[len(sent):]})
            else:
                deltas.append(call.as_json(index))
            self.calls.append(call)
        if not final and hasattr(self.fmt, "open_call") and (found := self.fmt.open_call(text)) is not None:
            name, arguments = found
            if self.open is None:
                self.open = (ToolCall(name=name, arguments=""), "")
                deltas.append(self.open[0].as_json(len(self.calls)))
            opened, sent = self.open
            if len(arguments) > len(sent) and arguments.startswith(sent):
                deltas.append({"index": len(self.calls), "arguments": arguments[len(sent):]})
                self.open = (opened, arguments)
        return content, deltas
