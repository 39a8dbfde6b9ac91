"""The completion routes' answers as a client sees them, head and body, whichever way the gateway serves them:
the headers the platform's HTTPS policy adds, the rate-limit headers, the request id, and errors in OpenAI's shape."""

import json
from types import SimpleNamespace

import httpx
import pytest

from tests.gateway.conftest import BASE_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

SECURITY = {"x-content-type-options": "nosniff", "referrer-policy": "same-origin", "cross-origin-opener-policy": "same-origin"}
RATELIMIT = {f"x-ratelimit-{name}" for name in ("limit-requests", "limit-tokens", "remaining-requests", "remaining-tokens",
                                                "reset-requests", "reset-tokens")}  # fmt: skip
PAYLOADS = {
    "chat/completions": {"model": BASE_MODEL, "messages": [{"role": "user", "content": "w20 w21"}], "max_tokens": 3},
    "completions": {"model": BASE_MODEL, "prompt": "w20 w21", "max_tokens": 3},
}


def _post(stack, route: str, body, *, key: str | None = None, headers: dict | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key or stack.keys['main']}", **(headers or {})}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{stack.gateways[0]}/{route}", content=content, headers=headers, timeout=60)


def _names(response: httpx.Response) -> set[str]:
    return {name.lower() for name in response.headers} - {"date", "server", "content-length", "transfer-encoding"}


@pytest.mark.parametrize("route", PAYLOADS)
def test_a_stream_has_the_head_and_body_of_the_platform(stack, route):
    response = _post(stack, route, PAYLOADS[route] | {"stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200, response.text
    assert _names(response) == {"content-type", "cache-control", "x-accel-buffering", "x-request-id"} | RATELIMIT | set(SECURITY)
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache" and response.headers["x-accel-buffering"] == "no"
    assert {name: response.headers[name] for name in SECURITY} == SECURITY
    assert response.headers["transfer-encoding"] == "chunked"
    assert int(response.headers["x-ratelimit-remaining-requests"]) < int(response.headers["x-ratelimit-limit-requests"])
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    request_id = response.headers["x-request-id"]
    assert all(chunk["id"].endswith(request_id) for chunk in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("route", PAYLOADS)
def test_a_whole_answer_has_the_head_of_the_platform(stack, route):
    response = _post(stack, route, PAYLOADS[route])
    assert response.status_code == 200, response.text
    assert _names(response) == {"content-type", "x-request-id"} | RATELIMIT | set(SECURITY)
    assert response.headers["content-type"] == "application/json"
    assert {name: response.headers[name] for name in SECURITY} == SECURITY
    assert response.json()["id"].endswith(response.headers["x-request-id"])


@pytest.mark.parametrize(
    ("body", "key", "status", "code", "ratelimited"),
    [
        (b"{not json", None, 400, None, True),
        ({"model": BASE_MODEL, "prompt": "w1", "max_tokens": 0}, None, 400, None, True),
        ({"model": "no-such-model", "prompt": "w1"}, None, 404, "model_not_found", True),
        ({"model": BASE_MODEL, "prompt": "w1"}, "qk-not-a-key", 401, "invalid_api_key", False),
    ],
    ids=["bad-json", "bad-field", "unknown-model", "bad-key"],
)
def test_a_refusal_has_the_error_shape_and_head(stack, body, key, status, code, ratelimited):
    response = _post(stack, "completions", body, key=key)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    assert response.headers["content-type"] == "application/json" and response.headers["x-request-id"]
    assert {name: response.headers[name] for name in SECURITY} == SECURITY
    assert (RATELIMIT <= _names(response)) is ratelimited


@pytest.mark.parametrize(
    ("content_type", "status"),
    [("application/json; charset=utf-8", 200), ("Application/JSON", 200), ("text/plain; charset=utf-8", 415)],
)
def test_the_content_type_is_read_as_django_reads_it(stack, content_type, status):
    response = _post(stack, "chat/completions", PAYLOADS["chat/completions"] | {"stream": True},
                     headers={"Content-Type": content_type})  # fmt: skip
    assert response.status_code == status, response.text
    if status == 415:
        assert response.json()["error"]["code"] == "unsupported_media_type"


def test_other_methods_on_a_completion_route_are_refused(stack):
    response = httpx.get(f"{stack.gateways[0]}/completions", headers={"Authorization": f"Bearer {stack.keys['main']}"})
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert {name: response.headers[name] for name in SECURITY} == SECURITY



def _read_answer(sock, buffered: bytes) -> tuple[bytes, dict[str, str], bytes, bytes]:
    """One whole answer from `sock` (after `buffered`, bytes read already), by Content-Length or chunked: its status
    line, its headers, its body, and what was read past it."""
    data = buffered

    def until(size: int) -> None:
        nonlocal data
        while len(data) < size:
            data += sock.recv(65536) or pytest.fail(f"the connection closed mid-answer: {data!r}")

    while b"\r\n\r\n" not in data:
        until(len(data) + 1)
    head, data = data.split(b"\r\n\r\n", 1)
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
    if "content-length" in headers:
        length = int(headers["content-length"])
        until(length)
        return status.encode(), headers, data[:length], data[length:]
    assert headers["transfer-encoding"] == "chunked"
    body = b""
    while True:
        while b"\r\n" not in data:
            until(len(data) + 1)
        size_line, data = data.split(b"\r\n", 1)
        size = int(size_line, 16)
        until(size + 2)
        body, data = body + data[:size], data[size + 2 :]
        if size == 0:
            return status.encode(), headers, body, data


def test_requests_pipelined_on_one_connection_are_answered_in_order_and_it_stays_open(stack):
    """Two requests written back to back on one kept-alive connection (HTTP/1.1 pipelining) get two whole answers, in
    order, each with its own id; the connection then serves a third."""
    import socket

    url = httpx.URL(stack.gateways[0])
    body = json.dumps(PAYLOADS["completions"]).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
               b"Authorization: Bearer %b\r\nContent-Length: %d\r\n\r\n%b" % (stack.keys["main"].encode(), len(body), body))  # fmt: skip
    with socket.create_connection((url.host, url.port), timeout=60) as sock:
        sock.sendall(request + request)
        answers, rest = [], b""
        for _ in range(2):
            status, headers, answer, rest = _read_answer(sock, rest)
            answers.append((status, headers["x-request-id"], json.loads(answer)["id"]))
        sock.sendall(request)
        status, headers, answer, rest = _read_answer(sock, rest)
        answers.append((status, headers["x-request-id"], json.loads(answer)["id"]))
    assert [status for status, _, _ in answers] == [b"HTTP/1.1 200 OK"] * 3
    assert len({request_id for _, request_id, _ in answers}) == 3
    assert all(completion_id.endswith(request_id) for _, request_id, completion_id in answers)
    assert rest == b""


def test_the_urlconfs_view_answers_through_the_same_chain(stack):
    """Django's own way in (the URLconf's view, as Django's test client calls it) answers a completion request as the
    ASGI entry does: here a refused key, with the error's shape, its request id and the HTTPS policy's headers."""
    from django.test import Client

    bad_key = {"HTTP_AUTHORIZATION": "Bearer qk-not-a-key"}
    served = _post(stack, "completions", {"model": BASE_MODEL, "prompt": "w1"}, key="qk-not-a-key")
    viewed = Client().post("/v1/completions", data={"model": BASE_MODEL, "prompt": "w1"},
                           content_type="application/json", **bad_key)  # fmt: skip
    assert viewed.status_code == served.status_code == 401
    assert json.loads(viewed.content) == served.json()
    assert viewed.headers["x-request-id"] and viewed.headers["x-request-id"] != served.headers["x-request-id"]
    assert {name: viewed.headers[name] for name in SECURITY} == SECURITY

PROXY = ("HTTP_X_FORWARDED_PROTO", "https")


@pytest.mark.parametrize("proxy_header", [None, PROXY], ids=["no-proxy-header", "proxy-header"])
@pytest.mark.parametrize(
    ("scheme", "headers"),
    [
        ("http", []),
        ("https", []),
        ("http", [(b"x-forwarded-proto", b"https")]),
        ("https", [(b"x-forwarded-proto", b"http")]),
        ("http", [(b"x-forwarded-proto", b" https , http")]),
        ("http", [(b"x-forwarded-proto", b"http"), (b"x-forwarded-proto", b"https")]),
        ("http", [(b"x-forwarded-proto", b"https"), (b"x-forwarded-proto", b"http")]),
        ("http", [(b"x_forwarded_proto", b"https")]),  # Django ignores names with underscores
    ],
)
@pytest.mark.parametrize("hsts", [0, 3600])
@pytest.mark.parametrize("redirect", [False, True])
def test_the_fast_paths_https_policy_is_djangos(settings, scheme, headers, proxy_header, hsts, redirect):
    """What the fast path decides from the ASGI scope (secure or not, redirected or not, which headers it adds) is
    what Django's SecurityMiddleware decides for the ASGIRequest of the same scope."""
    import io

    from django.core.handlers.asgi import ASGIRequest
    from django.http import HttpResponse
    from django.middleware.security import SecurityMiddleware

    from gateway.asgi import HttpsPolicy

    settings.SECURE_PROXY_SSL_HEADER = proxy_header
    settings.SECURE_SSL_REDIRECT = redirect
    settings.SECURE_HSTS_SECONDS = hsts
    settings.SECURE_HSTS_PRELOAD = True
    settings.ALLOWED_HOSTS = ["gateway.example"]
    middleware = SecurityMiddleware(lambda request: None)
    policy = HttpsPolicy(middleware)
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "", "query_string": b"",
             "scheme": scheme, "headers": [(b"host", b"gateway.example"), *headers], "server": ("127.0.0.1", 8000)}  # fmt: skip
    request = ASGIRequest(scope, io.BytesIO(b""))
    secure = policy.secure(scope)
    assert secure == request.is_secure()
    assert policy.redirects(secure=secure) == (middleware.process_request(request) is not None)
    answered = middleware.process_response(request, HttpResponse(content_type="text/event-stream"))
    added = [(name.lower().encode(), value.encode()) for name, value in answered.items() if name != "Content-Type"]
    assert policy.added[secure] == added
    assert (b"strict-transport-security" in dict(added)) is (bool(hsts) and secure)


def test_a_client_that_goes_away_cancels_its_request_and_only_then():
    """The client's disconnect cancels its request (the request's `finally` runs: the hold is settled, the engine
    request aborted) and the server's task ends normally; the server's own cancellation still ends the task."""
    import asyncio

    from gateway.disconnects import until_disconnected as _until_disconnected

    async def scenario(*, client_leaves: bool) -> list[str]:
        happened = []
        left = asyncio.Event()

        async def receive():
            await left.wait()
            return {"type": "http.disconnect"}

        async def serving():
            try:
                await asyncio.sleep(30)
                happened.append("finished")
            finally:
                happened.append("cleaned up")

        task = asyncio.create_task(_until_disconnected(serving(), receive))
        await asyncio.sleep(0.01)
        if client_leaves:
            left.set()
        else:
            task.cancel()
        done, _ = await asyncio.wait({task}, timeout=5)
        assert done, "the request was not cancelled"
        happened.append("cancelled" if task.cancelled() else "returned")
        happened.append(f"cancelling={task.cancelling()}")
        return happened

    assert asyncio.run(scenario(client_leaves=True)) == ["cleaned up", "returned", "cancelling=0"]
    assert asyncio.run(scenario(client_leaves=False)) == ["cleaned up", "cancelled", "cancelling=1"]


def test_a_client_that_goes_away_while_its_hold_is_settled_lets_the_settle_finish():
    """The stream's settle runs in the request's own task (no shield): a disconnect that comes while it runs does not
    cancel it, so the hold is released whole; a disconnect before it still cancels the request."""
    import asyncio

    from gateway.disconnects import until_disconnected as _until_disconnected
    from gateway.exchange import Exchange

    async def scenario(*, leave_while_settling: bool) -> list[str]:
        happened = []
        left, settling = asyncio.Event(), asyncio.Event()

        async def receive():
            await left.wait()
            return {"type": "http.disconnect"}

        exchange = object.__new__(Exchange)  # the real settle(), around a slow stand-in for its Redis script
        exchange._settled, exchange.caller = False, SimpleNamespace(tenant_id=1)

        async def slow_settle():
            settling.set()
            await asyncio.sleep(0.2)
            happened.append("hold released")

        exchange._settle = slow_settle

        async def serving():
            try:
                if not leave_while_settling:
                    await asyncio.sleep(30)
            finally:
                await exchange.settle()
                happened.append("after the settle")

        task = asyncio.create_task(_until_disconnected(serving(), receive))
        if leave_while_settling:
            await settling.wait()
        else:
            await asyncio.sleep(0.01)
        left.set()
        done, _ = await asyncio.wait({task}, timeout=5)
        assert done
        happened.append("cancelled" if task.cancelled() else "returned")
        return happened

    assert asyncio.run(scenario(leave_while_settling=True)) == ["hold released", "after the settle", "returned"]
    assert asyncio.run(scenario(leave_while_settling=False)) == ["hold released", "after the settle", "returned"]


def test_a_client_gone_before_a_streams_first_chunk_still_has_its_hold_settled_once(monkeypatch):
    """The stream's body owns the hold once the chain answers with it; a client that leaves while the head is written
    (the cancellation lands before the body is read at all) still has the hold settled, once."""
    import asyncio

    from gateway import asgi, generation
    from gateway.exchange import Exchange

    exchange = object.__new__(Exchange)  # the real settle(), around a stand-in for its Redis script
    exchange._settled, exchange.caller = False, SimpleNamespace(tenant_id=1)
    settled = []

    async def settle_script():
        settled.append("hold released")

    exchange._settle = settle_script

    async def answered(**kwargs):
        return generation.Stream(SimpleNamespace(exchange=exchange), {}, "r1")

    async def send(message):
        raise asyncio.CancelledError  # the head's write waited for a slow client, which left meanwhile

    monkeypatch.setattr(asgi, "generate", answered)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(asgi._generate({"headers": []}, b"{}", send, kind="completion", secure=False, received=0.0))
    assert settled == ["hold released"]
