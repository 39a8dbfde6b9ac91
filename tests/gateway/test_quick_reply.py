"""The lean Redis wire's quick read of a script's usual reply (issue 37, item 23): the acquire's reply read by one
regex into the Decision that parsing it and `_decision` make, the settle's integer into the integer; a reply that
arrives in pieces, or is of another shape (an error, a bulk string with CR LF), is parsed as before."""

import asyncio
import itertools
import random

import pytest

from gateway.admission.limits import Decision
from gateway.admission.redis_backend import _ACQUIRED, _INTEGER, _WIRE, _acquired, _decision
from gateway.admission.redis_wire import QuickReply, _Connection, _parse, _ServerError

REASONS = ["ok", "requests", "tokens", "concurrency", "month_unknown", "budget_tokens", "budget_held",
           "budget_spend", "key_requests", "key_tokens", "key_month_unknown", "key_budget_spend", "key_budget_held"]  # fmt: skip
NUMBERS = [0, 1, -1, 7, 59_999, 60_000, 2**40, -(2**40)]


def acquire_reply(admitted: int, reason: str, requests: int, tokens: int, reset_ms: int, key_requests: int,
                  key_tokens: int) -> bytes:  # fmt: skip
    return b"*7\r\n:%d\r\n$%d\r\n%b\r\n:%d\r\n:%d\r\n:%d\r\n:%d\r\n:%d\r\n" % (
        admitted, len(reason), reason.encode(), requests, tokens, reset_ms, key_requests, key_tokens)  # fmt: skip


def replies():
    rng = random.Random(23)
    for admitted, reason in itertools.product([0, 1], REASONS):
        yield acquire_reply(admitted, reason, *rng.sample(NUMBERS, 5))
    for _ in range(300):
        yield acquire_reply(rng.choice([0, 1, 2, -1]), rng.choice(REASONS), *(rng.choice(NUMBERS) for _ in range(5)))


def answer(quick: QuickReply | None, *pieces: bytes):
    loop = asyncio.new_event_loop()
    try:
        connection = _Connection(loop)
        waiter = connection._waiter = loop.create_future()
        connection._quick = quick
        for piece in pieces:
            connection.data_received(piece)
        assert waiter.done() and connection._waiter is None and not connection._buffer
        return waiter.result()
    finally:
        loop.close()


@pytest.mark.parametrize("reply", list(replies()))
def test_the_acquires_reply_reads_as_its_parse_and_decision(reply):
    parsed, end = _parse(bytearray(reply), 0)
    assert end == len(reply)
    expected = _decision(parsed)
    quick = _acquired(_ACQUIRED.pattern.fullmatch(reply))
    assert type(quick) is Decision and quick == expected
    assert tuple(quick) == (expected.admitted, expected.reason, expected.window_requests, expected.window_tokens,
                            expected.reset_ms, expected.key_window_requests, expected.key_window_tokens)  # fmt: skip
    assert answer(_ACQUIRED, reply) == expected  # whole in one arrival: the quick read
    for cut in (1, len(reply) // 2, len(reply) - 1):  # in two: parsed, the list `_decision` reads
        split = answer(_ACQUIRED, reply[:cut], reply[cut:])
        assert type(split) is list and _decision(split) == expected


@pytest.mark.parametrize("reply", [
    b"-NOSCRIPT No matching script. Please use EVAL.\r\n", b"*7\r\n:1\r\n$4\r\no\r\nk\r\n:1\r\n:2\r\n:3\r\n:4\r\n:5\r\n",
    b"*7\r\n:1\r\n$2\r\nOK\r\n:1\r\n:2\r\n:3\r\n:4\r\n:5\r\n", b"*3\r\n:1\r\n:2\r\n:3\r\n", b":5\r\n", b"$-1\r\n",
    b"*7\r\n:1\r\n$2\r\nok\r\n:1\r\n:2\r\n:3\r\n:4\r\n-ERR x\r\n", b"*7\r\n:+1\r\n$2\r\nok\r\n:1\r\n:2\r\n:3\r\n:4\r\n:5\r\n",
], ids=["error", "bulk-with-crlf", "upper-case", "three", "integer", "null", "error-inside", "plus-sign"])  # fmt: skip
def test_another_reply_to_the_acquire_is_parsed_as_before(reply):
    parsed, _ = _parse(bytearray(reply), 0)
    got = answer(_ACQUIRED, reply)
    if isinstance(parsed, _ServerError):
        assert isinstance(got, _ServerError) and str(got) == str(parsed)
    else:
        assert got == parsed and type(got) is type(parsed)


def test_a_bulk_string_shorter_than_its_length_is_left_to_the_parse():
    """The pattern cannot check a bulk string's length: the read refuses the reply and the parse reads it."""
    assert _acquired(_ACQUIRED.pattern.fullmatch(b"*7\r\n:1\r\n$3\r\nok\r\n:1\r\n:2\r\n:3\r\n:4\r\n:5\r\n")) is None


@pytest.mark.parametrize("reply", [b":0\r\n", b":1\r\n", b":-1\r\n", b":1234567890123\r\n"])
def test_the_settles_integer_reads_as_its_parse(reply):
    assert _WIRE["settle"].quick is _INTEGER
    assert answer(_INTEGER, reply) == _parse(bytearray(reply), 0)[0]
    assert answer(_INTEGER, reply[:2], reply[2:]) == _parse(bytearray(reply), 0)[0]


def test_a_reply_that_arrives_with_no_command_waiting_is_kept_for_the_next():
    """As before: bytes no command asked for stay in the connection's buffer (and the quick read is not tried)."""
    loop = asyncio.new_event_loop()
    try:
        connection = _Connection(loop)
        connection._quick = _INTEGER
        connection.data_received(b":1\r\n")
        assert bytes(connection._buffer) == b":1\r\n"
    finally:
        loop.close()


def test_bytes_already_buffered_are_read_first_as_before():
    """A reply that arrives whole while earlier bytes wait in the buffer is not read on its own: the buffer's reply
    comes first, as the parse reads them."""
    reply = acquire_reply(1, "ok", 1, 10, 60_000, 0, 0)
    loop = asyncio.new_event_loop()
    try:
        connection = _Connection(loop)
        connection._quick = _ACQUIRED
        connection.data_received(b":7\r\n")  # no command waiting
        waiter = connection._waiter = loop.create_future()
        connection.data_received(reply)
        assert waiter.result() == 7 and bytes(connection._buffer) == reply
    finally:
        loop.close()
