"""The RESP2 reply parser of admission's Redis connections, against a plain recursive reading of the protocol: the
same value and end for a whole reply, `_Incomplete` for every prefix of one."""

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
]  # fmt: skip


@pytest.mark.parametrize("reply", REPLIES)
def test_a_whole_reply_and_every_prefix_of_it(reply):
    for tail in (b"", b":9\r\n"):  # alone, and with the next reply already arrived
        value, end = _parse(bytearray(reply + tail), 0)
        assert (plain(value), end) == reference(reply, 0)
    for cut in range(len(reply)):
        with pytest.raises(_Incomplete):
            _parse(bytearray(reply[:cut]), 0)
