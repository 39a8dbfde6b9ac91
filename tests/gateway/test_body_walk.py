"""`parse_body` skips the walk over every value for a body whose raw bytes cannot hold what the walk looks for, and
gives the same body or the same 400 as parsing and walking it always."""

import json

import pytest

from gateway.errors import ApiError
from gateway.openai_request import parse_body
from gateway.request_guard import MAX_DEPTH, body_check


def walked(raw: bytes):
    """What `parse_body` answered before the raw check: parse, then always walk."""
    try:
        body = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError, RecursionError):
        return "not json"
    if not isinstance(body, dict):
        return "not an object"
    try:
        body_check(body)
    except ApiError as error:
        return (error.status, error.message, error.param)
    return body


def answered(raw: bytes):
    try:
        return parse_body(raw)
    except ApiError as error:
        if "not valid JSON" in error.message or "nested too deeply" in error.message:
            return "not json"
        if "must be a JSON object" in error.message:
            return "not an object"
        return (error.status, error.message, error.param)


def nested(levels: int, inner: str = "1") -> bytes:
    return ('{"model": "m", "x": ' + "[" * levels + inner + "]" * levels + "}").encode()


BODIES = [
    b'{"model": "m", "messages": [{"role": "user", "content": "hi [x] {y}"}], "stream": true}',
    b'{"model": "m", "prompt": "caf\xc3\xa9 \xe2\x98\x83", "max_tokens": 3}',
    '{"model": "m", "prompt": "\ud7ff hangul end"}'.encode(),  # 0xED in UTF-8, not a surrogate
    b'{"model": "m", "prompt": "\\ud800"}',  # an escaped lone surrogate
    b'{"model": "m", "prompt": "\\ud83d\\ude00"}',  # an escaped pair: one character
    b'{"model": "m", "prompt": "\xed\xa0\x80"}',  # a surrogate in raw UTF-8 (json decodes with surrogatepass)
    b'{"model": "m", "user": "a\\u0000b"}',
    b'{"model": "m\\u0000"}',
    b'{"model": "m", "messages": [{"role": "user", "name": "a\\u0000", "content": "x"}]}',
    b'{"model": "m", "\\udc00": 1}',
    '{"model": "m", "prompt": "\ud800"}'.encode("utf-16", "surrogatepass"),
    '{"model": "m", "prompt": "\ud800"}'.encode("utf-32", "surrogatepass"),
    '{"model": "m", "prompt": "fine"}'.encode("utf-16"),
    b'{"model": "' + b"m" * 300 + b'"}',
    nested(MAX_DEPTH - 2),
    nested(MAX_DEPTH - 1),
    nested(MAX_DEPTH),
    nested(MAX_DEPTH - 1, '{"a": 1}'),
    nested(MAX_DEPTH - 1, "{}"),
    nested(MAX_DEPTH - 1, '"\\ud800"'),
    b"[1]",
    b"",
    b"{",
]


@pytest.mark.parametrize("raw", BODIES)
def test_the_same_body_or_the_same_400_as_walking_every_value(raw):
    assert answered(raw) == walked(raw)


def test_what_the_walk_finds_is_still_found():
    assert walked(nested(MAX_DEPTH))[1].startswith("The request body is nested")
    assert "lone UTF-16 surrogate" in walked(b'{"model": "m", "prompt": "\xed\xa0\x80"}')[1]
    assert "NUL" in walked(b'{"model": "m", "user": "a\\u0000b"}')[1]
