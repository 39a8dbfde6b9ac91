"""The gateway's server protocol (gateway/http_protocol.py) in-process, over a transport that records each write: the
same bytes as uvicorn's own protocol, in fewer writes, and a client's going told without a listener task."""

import asyncio
import threading
from types import SimpleNamespace

import pytest
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.disconnects import until_disconnected as _until_disconnected
from gateway.disconnects import until_told_disconnected as _until_told_disconnected
from gateway.exchange import Exchange
from gateway.http_protocol import EXTENSION, GatewayHttpProtocol
from gateway.running_loop import current_task, running_loop

REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
HEAD = {"type": "http.response.start", "status": 200,
        "headers": [(b"content-type", b"text/event-stream"), (b"x-request-id", b"abc")]}  # fmt: skip
FIRST = {"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}
LAST = {"type": "http.response.body", "body": b"data: [DONE]\n\n"}


class Recorder:
    """A transport that keeps what each write sent."""

    def __init__(self):
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str):
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def connect(protocol_class, app, *, keep_alive: float = 5.0) -> tuple:
    """A server protocol of `protocol_class` for `app`, connected to a Recorder: (protocol, transport)."""
    config = Config(app=app, http=protocol_class, lifespan="off", log_level="warning", timeout_keep_alive=keep_alive)
    config.load()
    state = ServerState()
    state.default_headers = [(b"date", b"Sat, 28 Nov 2026 19:00:00 GMT"), (b"server", b"uvicorn")]
    protocol = protocol_class(config=config, server_state=state, app_state={})
    transport = Recorder()
    protocol.connection_made(transport)
    return protocol, transport


async def _serve(protocol_class, app, *, leave_after: float | None = None, request: bytes = REQUEST) -> Recorder:
    protocol, transport = await connect(protocol_class, app)
    protocol.data_received(request)
    if leave_after is not None:
        await asyncio.sleep(leave_after)
        protocol.connection_lost(None)
    await asyncio.wait_for(asyncio.gather(*protocol.tasks), timeout=5)
    return transport


async def _stream(scope, receive, send) -> None:
    await receive()
    await respond(scope, send)


async def respond(scope, send) -> None:
    cycle = scope.get("extensions", {}).get(EXTENSION)
    if cycle is None:
        await send(HEAD)
        await send(FIRST)
    else:
        await cycle.start_with_body(HEAD, FIRST)
    await send(LAST)


@pytest.mark.parametrize("headers", [
    HEAD["headers"],
    [*HEAD["headers"], (b"x-ratelimit-reset-requests", b"0.125s"), (b"x-odd", b"caf\xc3\xa9 (a; b=c)")],
    [(b"Content-Type", b"text/event-stream")],  # a name not in lower case: uvicorn's send writes it
    [(b"connection", b"close"), (b"x-request-id", b"abc")],  # a special name: uvicorn's send decides
    [],
])  # fmt: skip
@pytest.mark.parametrize("request_bytes", [REQUEST, REQUEST.replace(b"HTTP/1.1", b"HTTP/1.0")],
                         ids=["keep-alive", "http/1.0"])  # fmt: skip
def test_the_head_leaves_with_the_first_chunk_as_uvicorns_own_bytes(headers, request_bytes):
    async def stream(scope, receive, send):
        await receive()
        start = {**HEAD, "headers": headers}
        cycle = scope.get("extensions", {}).get(EXTENSION)
        if cycle is None:
            await send(start)
            await send(FIRST)
        else:
            await cycle.start_with_body(start, FIRST)
        await send(LAST)

    plain = asyncio.run(_serve(HttpToolsProtocol, stream, request=request_bytes))
    ours = asyncio.run(_serve(GatewayHttpProtocol, stream, request=request_bytes))
    assert len(plain.writes) == 3 and len(ours.writes) == 2
    assert ours.writes[0] == plain.writes[0] + plain.writes[1]
    assert b"".join(ours.writes) == b"".join(plain.writes) and ours.closed == plain.closed
    assert ours.writes[0].startswith(b"HTTP/1.") and b"transfer-encoding: chunked" in ours.writes[0]


@pytest.mark.parametrize("header", [(b"x-bad", b"a\nb"), (b"x bad", b"a"), (b"x-bad", b"\x00")])
def test_an_invalid_header_is_refused_as_uvicorn_refuses_it(header):
    errors = []

    async def stream(scope, receive, send):
        await receive()
        try:
            await scope["extensions"][EXTENSION].start_with_body({**HEAD, "headers": [header]}, FIRST)
        except RuntimeError as error:
            errors.append(str(error))
            raise

    asyncio.run(_serve(GatewayHttpProtocol, stream))
    assert errors and errors[0].startswith("Invalid HTTP header")


def test_a_request_is_told_when_its_client_goes_away_and_only_then():
    """Under the gateway's protocol the request runs with no listener task; the connection's loss cancels it (its
    `finally` runs) and the server's task ends normally; a request that finishes is not cancelled afterwards."""
    happened = []

    async def app(scope, receive, send):
        await receive()
        cycle = scope["extensions"][EXTENSION]

        async def serving():
            try:
                await send(HEAD)
                await asyncio.sleep(30)
            finally:
                happened.append("cleaned up")

        await _until_told_disconnected(serving(), cycle)
        happened.append(f"returned, cancelling={current_task().cancelling()}")

    transport = asyncio.run(_serve(GatewayHttpProtocol, app, leave_after=0.05))
    assert happened == ["cleaned up", "returned, cancelling=0"]
    assert len(transport.writes) == 1

    async def quick(scope, receive, send):
        await receive()

        async def serving():
            await respond(scope, send)

        await _until_told_disconnected(serving(), scope["extensions"][EXTENSION])
        happened.append("done")

    happened.clear()
    asyncio.run(_serve(GatewayHttpProtocol, quick))
    assert happened == ["done"]


@pytest.mark.parametrize("told", [False, True], ids=["listener", "told by the server"])
def test_a_client_that_goes_away_while_its_hold_is_settled_lets_the_settle_finish(told):
    """Both ways of hearing of a disconnect let a settle in progress finish (the hold is released whole)."""
    happened = []
    exchange = object.__new__(Exchange)  # the real settle(), around a slow stand-in for its Redis script
    exchange._settled, exchange.caller = False, SimpleNamespace(tenant_id=1)

    async def slow_settle():
        await asyncio.sleep(0.2)
        happened.append("hold released")

    exchange._settle = slow_settle

    async def serving():
        try:
            pass
        finally:
            await exchange.settle()
            happened.append("after the settle")

    async def app(scope, receive, send):
        await receive()
        if told:
            await _until_told_disconnected(serving(), scope["extensions"][EXTENSION])
        else:
            await _until_disconnected(serving(), receive)
        happened.append("returned")

    asyncio.run(_serve(GatewayHttpProtocol, app, leave_after=0.05))
    assert happened == ["hold released", "after the settle", "returned"]


def test_the_running_loop_is_the_one_running_now():
    """`running_loop` remembers a thread's loop, and takes the new one when another runs (each asyncio.run's)."""

    async def ask():
        assert current_task() is asyncio.current_task()
        return running_loop(), asyncio.get_running_loop()

    for _ in range(3):
        remembered, actual = asyncio.run(ask())
        assert remembered is actual
    seen = {}
    thread = threading.Thread(target=lambda: seen.update(pair=asyncio.run(ask())))
    thread.start()
    thread.join()
    assert seen["pair"][0] is seen["pair"][1]
    with pytest.raises(RuntimeError):
        running_loop()
