"""A regex from adapter_config.json is refused before `re` runs it when it could take exponential time: a repetition
or an alternative nested in a repetition, or more than three repetitions; `re`'s own syntax (escapes, sets, comments,
lookarounds) is read as `re` reads it."""

import pytest

from adapters.errors import AdapterError
from adapters.pattern_guard import check_pattern


@pytest.mark.parametrize("pattern", [
    r".*\.(q_proj|v_proj)$",
    r"model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj",
    r"\(a+\)+b",  # escaped parentheses are characters, not a group
    r"[(|]+x*",  # so are a set's
    r"[]|(]+",  # a set whose first member is ]
    r"(a|b)+",  # alternatives of one character each are a set
    r"(?:[ab]|\d)+",
    r"((a|b))+",
    r"(a*)?b",  # repeated at most once
    r"a(?#a comment)+",
    r"(?i)Q_PROJ|(?P<name>v)_proj(?P=name)?",
])
def test_patterns_that_match_in_bounded_time_pass(pattern):
    check_pattern(pattern, "target_modules")


@pytest.mark.parametrize(("pattern", "message"), [
    (r"(.*_proj)+", "nests a repetition"),
    (r"(a+)+$", "nests a repetition"),
    (r"((a*)?)+", "nests a repetition"),
    (r"(self_attn\.|mlp\.)*q_proj", "an alternative inside a repetition"),
    (r"(?:.|a)+", "an alternative inside a repetition"),  # `.` is no member of a set
    (r"(?:[^x]|y){2,}", "an alternative inside a repetition"),  # nor a negated set
    (r"(?:a(?#c)*)+", "nests a repetition"),  # a repetition after a comment repeats the atom before it
    (r".*.*.*.*z", "repeats 4 times"),
    (r"a+b{2,}c{,5}d*?", "repeats 4 times"),
])
def test_patterns_that_could_backtrack_for_hours_are_refused(pattern, message):
    with pytest.raises(AdapterError) as refused:
        check_pattern(pattern, "target_modules")
    assert refused.value.code == "config_too_complex" and message in refused.value.message


def test_an_invalid_pattern_is_refused_as_invalid():
    with pytest.raises(AdapterError) as refused:
        check_pattern(".*(q_proj", "target_modules")
    assert refused.value.code == "config_invalid" and "not a valid regular expression" in refused.value.message
