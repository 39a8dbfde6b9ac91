"""The gateway's server protocol's direct routes (gateway/http_protocol.py `DirectCycle`): a POST to a route the
application names goes to its `serve_direct` without ASGI's layers, with the bytes uvicorn's own path writes; what
needs those layers (proxy headers, another method, a query, 100-continue, HTTP/1.0) still takes them. And a kept-alive
connection's idle timer, made once per connection rather than once per response, still closes it on time."""

import asyncio
import time

import pytest
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.http_protocol import EXTENSION, DirectCycle, GatewayHttpProtocol
from tests.gateway.test_http_protocol import FIRST, HEAD, Recorder, connect, respond

ROUTE = b"/v1/completions"


def _request(body: bytes = b'{"a": 1}', *, head: bytes = b"POST /v1/completions HTTP/1.1", extra: bytes = b"") -> bytes:
    return head + b"\r\nHost: gateway\r\nContent-Type: application/json\r\n%bContent-Length: %d\r\n\r\n%b" % (
        extra, len(body), body)  # fmt: skip


class App:
    """An application with one direct route: each request's way in (`asgi` or `direct`) and body are kept, and its
    answer is the same stream either way."""

    def __init__(self):
        self.direct_routes = {ROUTE: "completion"}
        self.seen: list[tuple[str, bytes]] = []
        self.whole_at_start: list[bool] = []  # whether a direct request's body had all come when its task started
        self.waited: list[float] = []

    async def __call__(self, scope, receive, send):
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        self.seen.append(("asgi", body))
        await respond(scope, send)

    async def serve_direct(self, cycle, kind):
        assert isinstance(cycle, DirectCycle) and kind == "completion" and cycle.scope["path"] == "/v1/completions"
        self.whole_at_start.append(not cycle.more_body)
        self.waited.append(time.monotonic() - cycle.received)  # since the head came
        while cycle.more_body and not cycle.disconnected:  # as the gateway's own `serve_direct` reads
            await cycle.message_event.wait()
            cycle.message_event.clear()
        self.seen.append(("direct", cycle.body))
        await respond(cycle.scope, cycle.send)


async def _exchange(protocol_class, app, *parts: bytes) -> Recorder:
    protocol, transport = await connect(protocol_class, app)
    for part in parts:
        protocol.data_received(part)
        await asyncio.sleep(0.01)
    for _ in range(3):  # pipelined requests start once the one before has ended
        await asyncio.wait_for(asyncio.gather(*protocol.tasks), timeout=5)
        await asyncio.sleep(0)
    return transport


@pytest.mark.parametrize("parts", [
    [_request()],
    [_request()[:-8], _request()[-8:]],  # the body in a second arrival (as httpx often sends it)
    [_request(b"x" * 70_000)],  # past uvicorn's high-water mark: reading pauses and resumes
    [_request() + _request(b'{"b": 2}')],  # pipelined
], ids=["whole", "split body", "large body", "pipelined"])  # fmt: skip
def test_a_direct_route_is_served_directly_with_uvicorns_bytes(parts):
    plain_app, direct_app = App(), App()
    plain = asyncio.run(_exchange(HttpToolsProtocol, plain_app, *parts))
    ours = asyncio.run(_exchange(GatewayHttpProtocol, direct_app, *parts))
    assert [way for way, _ in plain_app.seen] == ["asgi"] * len(plain_app.seen)
    assert direct_app.seen == [("direct", body) for _, body in plain_app.seen]
    assert b"".join(ours.writes) == b"".join(plain.writes) and not ours.closed


def test_a_body_sent_after_its_head_is_not_waited_for_in_a_task():
    """The task starts once the body has come (not on the head, to wait in it), unless the body passes the high-water
    mark, where reading pauses until the task reads on."""
    app = App()
    asyncio.run(_exchange(GatewayHttpProtocol, app, _request()[:-8], _request()[-8:]))
    large = App()
    body = b"x" * 140_000
    asyncio.run(_exchange(GatewayHttpProtocol, large, _request(body)[:-70_000], _request(body)[-70_000:]))
    assert app.whole_at_start == [True] and app.seen == [("direct", b'{"a": 1}')]
    assert app.waited[0] >= 0.009  # the request's times start at its head's receipt (`_exchange` sent the body 10 ms on)
    assert large.whole_at_start == [False] and large.seen == [("direct", body)]


@pytest.mark.parametrize("request_bytes", [_request(), _request(head=b"POST /v1/models HTTP/1.0")],
                         ids=["keep-alive", "http/1.0"])  # fmt: skip
@pytest.mark.parametrize(("middle", "end"), [(b"data: 2\n\n", b"data: [DONE]\n\n"), (b"", b""), (b"x", b"")])
def test_a_body_written_at_once_is_the_servers_own_send(request_bytes, middle, end):
    """`write_now` writes what the server's `send` writes, and ends the response as it does (a connection not kept
    alive closed)."""

    def app(now: bool):
        async def answer(scope, receive, send):
            await receive()
            cycle = scope["extensions"][EXTENSION]
            await cycle.start_with_body(HEAD, FIRST)
            for data, more in ((middle, True), (end, False)):
                if not (now and cycle.write_now(data, more)):
                    await send({"type": "http.response.body", "body": data, "more_body": more})
            assert cycle.response_complete

        return answer

    sent = asyncio.run(_exchange(GatewayHttpProtocol, app(False), request_bytes))
    now = asyncio.run(_exchange(GatewayHttpProtocol, app(True), request_bytes))
    assert b"".join(now.writes) == b"".join(sent.writes) and now.closed == sent.closed
    assert now.closed == (b"HTTP/1.0" in request_bytes)


@pytest.mark.parametrize("request_bytes", [
    _request(extra=b"X-Forwarded-Proto: https\r\n"),  # uvicorn's proxy-headers middleware may change the scheme
    _request(extra=b"X-Forwarded-For: 10.0.0.1\r\n"),
    _request(extra=b"Expect: 100-continue\r\n"),
    _request(head=b"POST /v1/completions?x=1 HTTP/1.1"),
    _request(head=b"GET /v1/completions HTTP/1.1"),
    _request(head=b"POST /v1/completions HTTP/1.0"),
    _request(head=b"POST /v1/models HTTP/1.1"),
], ids=["x-forwarded-proto", "x-forwarded-for", "100-continue", "query", "GET", "HTTP/1.0", "another route"])  # fmt: skip
def test_what_needs_asgis_layers_takes_them(request_bytes):
    app = App()
    asyncio.run(_exchange(GatewayHttpProtocol, app, request_bytes))
    assert [way for way, _ in app.seen] == ["asgi"]


def test_a_client_that_goes_away_before_its_body_ends_is_not_served():
    async def scenario():
        app = App()
        protocol, _ = await connect(GatewayHttpProtocol, app)
        protocol.data_received(_request()[:-4])
        await asyncio.sleep(0.01)
        protocol.connection_lost(None)
        await asyncio.wait_for(asyncio.gather(*protocol.tasks), timeout=5)
        return app.seen

    assert asyncio.run(scenario()) == []  # its task is started once its body has come: it never came


def test_the_idle_timer_is_made_once_per_connection_and_still_closes_it_on_time():
    async def scenario():
        loop = asyncio.get_running_loop()
        made = []
        call_later = loop.call_later
        loop.call_later = lambda delay, callback, *args: made.append(callback) or call_later(delay, callback, *args)
        protocol, transport = await connect(GatewayHttpProtocol, App(), keep_alive=0.3)
        for _ in range(5):  # requests closer together than the timeout keep the connection open
            protocol.data_received(_request())
            await asyncio.sleep(0.1)
        assert not transport.closed
        await asyncio.sleep(0.45)  # then idle past it: closed
        closed = transport.closed
        protocol.connection_lost(None)
        return len([callback for callback in made if getattr(callback, "__self__", None) is protocol]), closed

    made, closed = asyncio.run(scenario())
    assert closed
    assert made <= 3  # uvicorn's own makes one per response: 5 here
