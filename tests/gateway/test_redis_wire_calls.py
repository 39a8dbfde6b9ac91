"""What one script costs the lean Redis wire in Python, counted (a count the machine's load does not change): the
calls it makes per command, and the bytecodes its reply parse runs for the acquire's reply. Against a fake Redis
that answers at once, so only the wire's own work is counted."""

import asyncio
import sys

from gateway.admission import redis_wire
from gateway.admission.redis_wire import RedisWire, WireScript

SCRIPT = WireScript("return 1")
ACQUIRED = b"*5\r\n:1\r\n$2\r\nok\r\n:1\r\n:10\r\n:60000\r\n"


class _Counter:
    """The wire's Python calls by function (a coroutine's each entry and resumption counted, as
    benchmarks.gateway_sections does) and the bytecodes its functions ran, while tracing."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.bytecodes = 0

    def __enter__(self):
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)

    def _trace(self, frame, event, arg):
        if frame.f_code.co_filename != redis_wire.__file__:
            return None
        if event == "call":
            self.calls[frame.f_code.co_name] = self.calls.get(frame.f_code.co_name, 0) + 1
            frame.f_trace_opcodes = True
        elif event == "opcode":
            self.bytecodes += 1
        return self._trace


async def _fake_redis(reply: bytes) -> tuple[RedisWire, asyncio.Server]:
    """A wire to a fake Redis that answers each EVALSHA with `reply`."""

    async def server(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(reply * data.count(b"EVALSHA"))
        except (asyncio.CancelledError, ConnectionError):  # the test is over
            pass
        writer.close()

    fake = await asyncio.start_server(server, "127.0.0.1", 0)
    return RedisWire(f"redis://127.0.0.1:{fake.sockets[0].getsockname()[1]}/0"), fake


async def _closed(wire: RedisWire, fake: asyncio.Server) -> None:
    for connection in wire._idle:
        connection.close()
    fake.close()
    await fake.wait_closed()


def test_a_command_is_one_coroutine_and_a_few_calls():
    """The command framed (`run_packed`), its coroutine entered and resumed once (its reply awaited; the connection
    taken and the command sent in it), the reply received and parsed: 5 calls."""

    async def main():
        wire, fake = await _fake_redis(b":1\r\n")
        assert await wire.run_packed(SCRIPT, 4, b"$1\r\n0\r\n") == 1  # the connection opened
        with _Counter() as counter:
            assert await wire.run_packed(SCRIPT, 4, b"$1\r\n0\r\n") == 1
        await _closed(wire, fake)
        return counter.calls

    calls = asyncio.run(main())
    assert calls == {"run_packed": 1, "run_message": 2, "data_received": 1, "_parse": 1}, calls


def test_the_acquires_reply_is_parsed_in_few_bytecodes():
    """An array of integers and a bulk string, the acquire's reply on every request: found by one regex, not read item
    by item (~300 bytecodes)."""
    with _Counter() as counter:
        reply = redis_wire._parse(bytearray(ACQUIRED), 0)
    assert reply == ([1, b"ok", 1, 10, 60000], len(ACQUIRED))
    assert counter.calls == {"_parse": 1} and counter.bytecodes <= 200, counter.bytecodes  # 175 in 3.11
