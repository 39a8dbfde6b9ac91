"""The parse's shortcuts for the common body give the same answers: `parse_body` skips the walk over every value
when the raw bytes cannot hold what the walk looks for; `_common` skips the sampling and unsupported names' checks
when the body names none of them."""

import json

import pytest

from gateway.errors import ApiError
from gateway.openai_request import UNSUPPORTED, parse_body, parse_chat, parse_completion
from gateway.request_guard import MAX_DEPTH, body_check


def walked(raw: bytes):
    """What `parse_body` answers without the raw check: parse, then always walk."""
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


SAMPLED = [({"temperature": 1}, {"temperature": 1.0}), ({"top_p": 0.5}, {"top_p": 0.5}), ({"top_p": 0}, {"top_k": 1}),
           ({"presence_penalty": -2}, {"presence_penalty": -2.0}), ({"frequency_penalty": 2}, {"frequency_penalty": 2.0}),
           ({"n": 2}, {"n": 2}), ({"seed": -5}, {"seed": -5}), ({"logit_bias": {"7": 1}}, {"logit_bias": {"7": 1.0}}),
           ({}, {}), ({"seed": None, "logit_bias": None}, {})]  # fmt: skip


@pytest.mark.parametrize("extra, sampling", SAMPLED)
def test_each_sampling_name_alone_is_read(extra, sampling):
    assert parse_completion({"model": "m", "prompt": "p", **extra}).sampling == sampling


@pytest.mark.parametrize("extra", [{"n": 0}, {"seed": 2**63}, {"temperature": "hot"}, {"top_p": 2}, {"n": True},
                                   {"logit_bias": {"x": 1}}])  # fmt: skip
def test_each_bad_sampling_value_alone_is_a_400(extra):
    with pytest.raises(ApiError) as refused:
        parse_completion({"model": "m", "prompt": "p", **extra})
    assert refused.value.status == 400 and refused.value.param == next(iter(extra))


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_each_unsupported_name_alone_is_a_400_and_an_empty_one_is_not(name):
    parse, fields = (parse_completion, {"model": "m", "prompt": "p"}) if name == "suffix" else \
        (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "c"}]})  # fmt: skip
    with pytest.raises(ApiError) as refused:
        parse({**fields, name: "x"})
    assert (refused.value.code, refused.value.param) == ("unsupported_parameter", name)
    assert parse({**fields, name: []}).sampling == {}
