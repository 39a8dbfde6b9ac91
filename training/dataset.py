"""Fine-tuning data files: JSONL, one example a line, in OpenAI's two formats, checked line by line.

- `supervised`: {"messages": [{"role": "system"|"user"|"assistant", "content": "...", "weight": 0|1}, ...]}
  with at least one assistant message to learn from.
- `dpo`: {"input": {"messages": [...]}, "preferred_output": [{"role": "assistant", "content": "..."}],
  "non_preferred_output": [{"role": "assistant", "content": "..."}]}

Every problem names its line (1-based), so a tenant can fix the file. No torch here: the platform imports it.
"""

import json
from dataclasses import dataclass

SUPERVISED, DPO = "supervised", "dpo"
METHODS = (SUPERVISED, DPO)
MIN_EXAMPLES = 10  # OpenAI's minimum
ROLES = ("system", "user", "assistant")
MAX_REPORTED = 5


@dataclass(frozen=True)
class LineError:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


class DatasetInvalid(ValueError):
    """The file can't be trained on; `errors` name each bad line (the first few are in the message)."""

    def __init__(self, errors: list[LineError], *, summary: str = ""):
        self.errors = errors
        shown = "; ".join(str(e) for e in errors[:MAX_REPORTED])
        more = f" (and {len(errors) - MAX_REPORTED} more)" if len(errors) > MAX_REPORTED else ""
        self.message = summary or f"{shown}{more}"
        super().__init__(self.message)


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    weight: int = 1  # assistant messages only: 0 means shown as context but not learned


@dataclass(frozen=True)
class SupervisedExample:
    line: int
    messages: tuple[Message, ...]


@dataclass(frozen=True)
class PreferenceExample:
    line: int
    messages: tuple[Message, ...]
    preferred: str
    non_preferred: str


Example = SupervisedExample | PreferenceExample


class _Bad(Exception):
    pass


def _content(value, where: str) -> str:
    if isinstance(value, list):  # content parts: text only
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _Bad(f"{where}: only text content parts are supported")
            parts.append(part["text"])
        value = "".join(parts)
    if not isinstance(value, str):
        raise _Bad(f"{where}: 'content' must be a string")
    if not value.strip():
        raise _Bad(f"{where}: 'content' is empty")
    return value


def _message(value, where: str, *, roles: tuple[str, ...] = ROLES) -> Message:
    if not isinstance(value, dict):
        raise _Bad(f"{where} is not an object")
    role = value.get("role")
    if role not in roles:
        raise _Bad(f"{where}: role {role!r} is not one of {', '.join(roles)}")
    if "tool_calls" in value or "function_call" in value:
        raise _Bad(f"{where}: tool and function calls are not supported")
    weight = value.get("weight", 1)
    if weight not in (0, 1) or isinstance(weight, bool) or (role != "assistant" and "weight" in value):
        raise _Bad(f"{where}: 'weight' must be 0 or 1, on assistant messages only")
    return Message(role=role, content=_content(value.get("content"), where), weight=weight)


def _messages(value, where: str) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise _Bad(f"'{where}' must be a non-empty list of messages")
    return tuple(_message(m, f"{where}[{i}]") for i, m in enumerate(value))


def _supervised(record: dict, line: int) -> SupervisedExample:
    messages = _messages(record.get("messages"), "messages")
    if not any(m.role == "assistant" and m.weight for m in messages):
        raise _Bad("the example has no assistant message to learn from")
    return SupervisedExample(line=line, messages=messages)


def _one_answer(value, where: str) -> str:
    if not isinstance(value, list) or len(value) != 1:
        raise _Bad(f"'{where}' must be a list of exactly one assistant message")
    return _message(value[0], f"{where}[0]", roles=("assistant",)).content


def _preference(record: dict, line: int) -> PreferenceExample:
    prompt = record.get("input")
    if not isinstance(prompt, dict):
        raise _Bad("'input' must be an object with 'messages'")
    messages = _messages(prompt.get("messages"), "input.messages")
    if messages[-1].role != "user":
        raise _Bad("'input.messages' must end with a user message")
    preferred = _one_answer(record.get("preferred_output"), "preferred_output")
    non_preferred = _one_answer(record.get("non_preferred_output"), "non_preferred_output")
    if preferred == non_preferred:
        raise _Bad("'preferred_output' and 'non_preferred_output' are the same")
    return PreferenceExample(line=line, messages=messages, preferred=preferred, non_preferred=non_preferred)


def method_of(record: dict) -> str | None:
    if "messages" in record:
        return SUPERVISED
    if "input" in record or "preferred_output" in record:
        return DPO
    return None


def parse(data: bytes, *, method: str | None = None, minimum: int = 0) -> tuple[str, list[Example]]:
    """The file's method (as given, or recognised from its first example) and its examples; DatasetInvalid
    naming every bad line otherwise, or when there are fewer than `minimum` examples."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise DatasetInvalid([LineError(line, "the file is not UTF-8 text")]) from None
    errors: list[LineError] = []
    examples: list[Example] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as error:
            errors.append(LineError(number, f"not valid JSON ({error.msg} at column {error.colno})"))
            continue
        if not isinstance(record, dict):
            errors.append(LineError(number, "each line must be a JSON object"))
            continue
        found = method_of(record)
        method = method or found
        if found is None or found != method:
            expected = "'messages'" if method == SUPERVISED else "'input', 'preferred_output', 'non_preferred_output'"
            errors.append(LineError(number, f"a {method or 'supervised'} example needs {expected}"))
            continue
        try:
            examples.append(_supervised(record, number) if method == SUPERVISED else _preference(record, number))
        except _Bad as bad:
            errors.append(LineError(number, str(bad)))
    if errors:
        raise DatasetInvalid(errors)
    if not examples:
        raise DatasetInvalid([], summary="the file has no examples")
    if len(examples) < minimum:
        raise DatasetInvalid(
            [], summary=f"the file has {len(examples)} examples; fine-tuning needs at least {minimum}"
        )
    return method or SUPERVISED, examples
