"""Regular expressions from a tenant's adapter_config.json, checked before Python's backtracking engine runs them.

target_modules, exclude_modules, layers_pattern and the rank/alpha pattern keys are regexes; `re` has no
timeout, so `(a+)+$` or a run of `.*` could hold a validation worker for hours. Nested repetition,
alternation inside repetition and more than a few repetitions are refused: no PEFT config needs them.

`re.compile` says whether a pattern is valid; the scan below reads only its structure (groups, alternatives,
repetitions, escapes and character sets), which `re` exposes through no public parse tree.
"""

import re
from dataclasses import dataclass

from adapters.errors import AdapterError

MAX_PATTERN_CHARS = 1000
MAX_REPETITIONS = 3

# a repetition: *, +, ?, {m}, {m,}, {,n}, {m,n}; a brace that is not one of these is a literal
QUANTIFIER = re.compile(r"[*+?]|\{(\d*)(,?)(\d*)\}")


@dataclass
class Group:
    """What a parenthesized group (or the whole pattern) holds, as far as the scan has read."""

    repeats: bool = False  # a repetition of any bound, at any depth
    branches: bool = False  # an alternative at any depth (one between single characters is a set)
    single_characters: bool = True  # every alternative so far is one character (then `a|b` is the set [ab])
    atoms_in_alternative: int = 0


def check_pattern(pattern: str, field: str) -> None:
    """Raise AdapterError unless `pattern` is a valid regex that matches module names in bounded time."""
    if not isinstance(pattern, str):
        raise AdapterError("config_invalid", f"{field} must hold strings, not {pattern!r}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise AdapterError("config_invalid", f"{field} pattern is longer than {MAX_PATTERN_CHARS} characters")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise AdapterError(
            "config_invalid", f"{field} pattern {pattern!r} is not a valid regular expression: {exc}"
        ) from None
    repetitions = count_repetitions(pattern, field)
    if repetitions > MAX_REPETITIONS:
        raise AdapterError(
            "config_too_complex",
            f"{field} pattern {pattern!r} repeats {repetitions} times (like .* or \\d+); "
            f"at most {MAX_REPETITIONS} are allowed",
        )


def count_repetitions(pattern: str, field: str) -> int:
    """The repetitions of a valid pattern whose upper bound is above one; AdapterError if one nests a repetition or
    an alternative."""
    stack, count, at, atom = [Group()], 0, 0, Group()
    while at < len(pattern):
        start, char = at, pattern[at]
        if pattern.startswith("(?#", at):  # a comment: a repetition after it repeats the atom before it
            at = pattern.index(")", at) + 1
        elif char == "(":
            stack.append(Group())
            at = skip_group_prefix(pattern, at)
            continue
        elif char == "|":
            group = stack[-1]
            group.single_characters &= group.atoms_in_alternative == 1
            group.atoms_in_alternative = 0
            group.branches = True  # until the group closes on single characters only
            at += 1
            continue
        else:
            if char == ")":  # the group is the atom a repetition after it repeats
                atom = close(stack.pop())
                stack[-1].repeats |= atom.repeats
                stack[-1].branches |= atom.branches
                at += 1
            else:  # one character, escape or set
                atom = Group()
                if char == "[":
                    at = skip_set(pattern, at)
                elif char == "\\":
                    at = skip_escape(pattern, at)
                else:
                    at += 1
            stack[-1].atoms_in_alternative += 1
            if char == ")" or not set_member(pattern[start:at]):
                stack[-1].single_characters = False
        quantifier = QUANTIFIER.match(pattern, at)
        if quantifier is None:
            continue
        at = quantifier.end()
        if at < len(pattern) and pattern[at] in "?+":  # lazy or possessive: the same repetition
            at += 1
        stack[-1].repeats = True
        stack[-1].single_characters = False
        if upper_bound(quantifier) > 1:
            if atom.repeats or atom.branches:
                raise nested(pattern, field)
            count += 1
    return count


def close(group: Group) -> Group:
    """A group as an atom: alternatives of one character each are a set, not a branch."""
    group.single_characters &= group.atoms_in_alternative == 1
    if group.single_characters:
        group.branches = False
    return group


def set_member(atom: str) -> bool:
    """Whether `re` merges this atom, as one alternative of several, into a character set: a literal, an escaped
    character or class, a set that is not negated; not `.`, an anchor or a backreference."""
    if atom in (".", "^", "$") or atom.startswith("[^"):
        return False
    return not (atom[0] == "\\" and atom[1] in "bBAZ123456789")


def upper_bound(quantifier: re.Match) -> float:
    if quantifier.group() in ("*", "+"):
        return float("inf")
    if quantifier.group() == "?":
        return 1
    low, comma, high = quantifier.groups()
    if not comma:
        return int(low)
    return int(high) if high else float("inf")


def skip_escape(pattern: str, at: int) -> int:
    if pattern.startswith("\\N{", at):
        return pattern.index("}", at) + 1
    return at + 2


def skip_set(pattern: str, at: int) -> int:
    """The index after the character set that opens at `at` (a `]` first, or after `^`, is a member)."""
    at += 1
    if at < len(pattern) and pattern[at] == "^":
        at += 1
    if at < len(pattern) and pattern[at] == "]":
        at += 1
    while pattern[at] != "]":
        at += 2 if pattern[at] == "\\" else 1
    return at + 1


def skip_group_prefix(pattern: str, at: int) -> int:
    """The index after a group's opening: `(`, `(?:`, `(?P<name>`, a lookaround or inline flags."""
    if not pattern.startswith("(?", at):
        return at + 1
    if pattern.startswith("(?P<", at) or pattern.startswith("(?<", at) and pattern[at + 3] not in "=!":
        return pattern.index(">", at) + 1
    if pattern.startswith("(?P=", at):
        return pattern.index(")", at)
    prefix = re.compile(r"\(\?(?:<?[=!]|[aiLmsux-]*:?)").match(pattern, at)
    return prefix.end()


def nested(pattern: str, field: str) -> AdapterError:
    return AdapterError(
        "config_too_complex",
        f"{field} pattern {pattern!r} nests a repetition or an alternative inside a repetition (like (a+)+), "
        "which can take exponential time to match; simplify it",
    )
