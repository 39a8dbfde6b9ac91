"""The RESP2 reply parser of admission's Redis connections, against a plain recursive reading of the protocol: the
same value and end for a whole reply, `_Incomplete` for every prefix of one."""

import random

import pytest

from gateway.admission.redis_wire import _Incomplete, _parse, _ServerError


def reference(data: bytes, start: int):
    end = data.index(b"\r\n", start)
    kind, head = data[start : start + 1], data[start + 1 : end]
    if kind == b":":
        return int(head), end + 2
    if kind == b"+":
        return head, end + 2
    if kind == b"-":
        return ("error", head.decode()), end + 2
    if kind == b"$":
        if int(head) < 0:
            return None, end + 2
        return data[end + 2 : end + 2 + int(head)], end + 4 + int(head)
    assert kind == b"*"
    if int(head) < 0:
        return None, end + 2
    items, position = [], end + 2
    for _ in range(int(head)):
        item, position = reference(data, position)
        items.append(item)
    errors = [item for item in items if isinstance(item, tuple)]
    return (errors[0] if errors else items), position


def plain(value):
    if isinstance(value, _ServerError):
        return ("error", str(value))
    return [plain(item) for item in value] if isinstance(value, list) else value


REPLIES = [
    b":42\r\n", b":-7\r\n", b"+OK\r\n", b"$2\r\nok\r\n", b"$-1\r\n", b"$0\r\n\r\n", b"$4\r\na\r\nb\r\n", b"*-1\r\n",
    b"*0\r\n", b"*5\r\n:1\r\n$2\r\nok\r\n:3\r\n:-40\r\n:59999\r\n", b"*3\r\n:-1\r\n:0\r\n:0\r\n",
    b"*2\r\n$-1\r\n*2\r\n:1\r\n$4\r\n:2\r\n\r\n", b"*3\r\n:1\r\n-NOSCRIPT no script\r\n:2\r\n",
    b"*2\r\n*1\r\n-ERR inner\r\n:5\r\n", b"-ERR plain\r\n", b"*2\r\n+PONG\r\n$1\r\n*\r\n",
    # bulk strings with CR LF inside that read as items if their length is not checked
    b"*2\r\n$5\r\nx\r\n:5\r\n:7\r\n", b"*3\r\n$8\r\nab\r\n$0\r\n\r\n$1\r\nc\r\n:1\r\n", b"*1\r\n$3\r\na\rb\r\n",
    b"*2\r\n:+5\r\n:007\r\n", b"*9\r\n" + b":1\r\n" * 9, b"*8\r\n" + b"$1\r\n\n\r\n" * 8,
]  # fmt: skip


@pytest.mark.parametrize("reply", REPLIES)
def test_a_whole_reply_and_every_prefix_of_it(reply):
    for tail in (b"", b":9\r\n"):  # alone, and with the next reply already arrived
        value, end = _parse(bytearray(reply + tail), 0)
        assert (plain(value), end) == reference(reply, 0)
    for cut in range(len(reply)):
        with pytest.raises(_Incomplete):
            _parse(bytearray(reply[:cut]), 0)


def _flat_reply(rng: random.Random) -> bytes:
    """An array of integers and bulk strings (what the scripts reply), the strings' bytes any, CR and LF often."""
    items = []
    for _ in range(rng.randint(0, 10)):
        if rng.random() < 0.5:
            items.append(b":%d\r\n" % rng.randint(-(10**12), 10**12))
        else:
            data = bytes(rng.choice(b"ab:$*-\r\n0123456789") for _ in range(rng.randint(0, 8)))
            items.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"*%d\r\n" % len(items) + b"".join(items)


@pytest.mark.parametrize("seed", range(20))
def test_arrays_of_integers_and_bulk_strings_at_random(seed):
    rng = random.Random(seed)
    for _ in range(50):
        reply = _flat_reply(rng)
        value, end = _parse(bytearray(reply + b"$1\r\n:\r\n"), 0)
        assert (plain(value), end) == reference(reply, 0), reply
        cut = rng.randrange(len(reply))
        with pytest.raises(_Incomplete):
            _parse(bytearray(reply[:cut]), 0)
