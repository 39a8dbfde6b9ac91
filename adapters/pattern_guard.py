"""Regular expressions from a tenant's adapter_config.json, checked before Python's backtracking engine runs them.

target_modules, exclude_modules, layers_pattern and the rank/alpha pattern keys are regexes; `re` has no
timeout, so `(a+)+$` or a run of `.*` could hold a validation worker for hours. Nested repetition,
alternation inside repetition and more than a few repetitions are refused: no PEFT config needs them.
The parse tree comes from `re._parser`, the stdlib's own parser (stable from Python 3.11 on).
"""

import re
from re import _constants, _parser

from adapters.errors import AdapterError

MAX_PATTERN_CHARS = 1000
MAX_REPETITIONS = 3
_REPEATS = (_constants.MAX_REPEAT, _constants.MIN_REPEAT, _constants.POSSESSIVE_REPEAT)


def check_pattern(pattern: str, field: str) -> None:
    """Raise AdapterError unless `pattern` is a valid regex that matches module names in bounded time."""
    if not isinstance(pattern, str):
        raise AdapterError("config_invalid", f"{field} must hold strings, not {pattern!r}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise AdapterError("config_invalid", f"{field} pattern is longer than {MAX_PATTERN_CHARS} characters")
    try:
        re.compile(pattern)
        tree = _parser.parse(pattern)
    except re.error as exc:
        raise AdapterError(
            "config_invalid", f"{field} pattern {pattern!r} is not a valid regular expression: {exc}"
        ) from None
    repetitions = _count_repetitions(tree, pattern=pattern, field=field, inside=False)
    if repetitions > MAX_REPETITIONS:
        raise AdapterError(
            "config_too_complex",
            f"{field} pattern {pattern!r} repeats {repetitions} times (like .* or \\d+); "
            f"at most {MAX_REPETITIONS} are allowed",
        )


def _count_repetitions(items: _parser.SubPattern, *, pattern: str, field: str, inside: bool) -> int:
    count = 0
    for op, value in items:
        if op in _REPEATS:
            _, high, body = value
            if inside:
                raise _nested(pattern, field)
            count += high > 1
            count += _count_repetitions(body, pattern=pattern, field=field, inside=high > 1)
        elif op is _constants.BRANCH and inside:
            raise _nested(pattern, field)
        else:
            for child in _subpatterns(value):
                count += _count_repetitions(child, pattern=pattern, field=field, inside=inside)
    return count


def _subpatterns(value: object) -> list[_parser.SubPattern]:
    if isinstance(value, _parser.SubPattern):
        return [value]
    if isinstance(value, list | tuple):
        return [child for item in value for child in _subpatterns(item)]
    return []


def _nested(pattern: str, field: str) -> AdapterError:
    return AdapterError(
        "config_too_complex",
        f"{field} pattern {pattern!r} nests a repetition or an alternative inside a repetition (like (a+)+), "
        "which can take exponential time to match; simplify it",
    )
