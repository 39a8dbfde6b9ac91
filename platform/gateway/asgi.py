"""The gateway's ASGI entry: `uvicorn gateway.asgi:application --app-dir platform --http
gateway.http_protocol:GatewayHttpProtocol` (the server's extension, `gateway/http_protocol.py`, saves the hot routes
a task and a write per request; under another server the application does without it).

The inference API (/v1/) is latency-critical: its async views are called straight from the ASGI scope, without
Django's request handler around them (which runs signal receivers and the response close in per-request
threads, several milliseconds under load) and without the console's middleware (sessions, CSRF, login
lockout: none applies to bearer-key API calls). Everything else is the platform's own application.

What Django's handler would do and this does too: read the body, route by the URLconf, turn a client
disconnect into cancelling the view (so its `finally` runs: the hold is settled, the engine request aborted),
and answer an unexpected error with a 500 in the API's error shape.

The two hot routes (POST /v1/chat/completions, /v1/completions) go further: `_generate` calls the views' own
services without building Django's request, and writes a stream's head and body itself (the head the view's
response would have had, the HTTPS policy's headers included); refusals and whole answers are the views'
responses. Other methods, a script prefix, and requests the HTTPS policy redirects take the general path.
"""

import asyncio
import functools
import gc
import io
import logging
import operator
import time
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace

from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpResponse, StreamingHttpResponse
from django.middleware.security import SecurityMiddleware
from django.urls import Resolver404, resolve
from django.utils.http import parse_header_parameters

from gateway import metrics
from gateway.connections import STORE_DOWN
from gateway.errors import ApiError, service_unavailable
from gateway.openai_response import DONE
from gateway.request_guard import body_limit, too_large
from quilt.asgi import application as platform_application  # sets Django up

log = logging.getLogger(__name__)

from gateway import relay, request_reports, views  # noqa: E402 - they need Django set up
from gateway.disconnects import until_disconnected, until_told_disconnected  # noqa: E402
from gateway.hot_settings import hot  # noqa: E402
from gateway.http_protocol import EXTENSION  # noqa: E402
from gateway.lifespan import lifespan  # noqa: E402
from gateway.request_ids import request_id_hex  # noqa: E402

PREFIX = "/v1/"
METRICS_PATH = "/metrics"


class _TooLarge(Exception):
    pass


async def _read_body(receive, limit: int, first: bytes = b"") -> bytes | None:
    """The whole request body (after `first`, its part read already), or None if the client went away first;
    _TooLarge past `limit` bytes."""
    chunks, size = [first], len(first)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            raise _TooLarge
        if not message.get("more_body", False):
            return b"".join(chunks)


def _headers(response) -> list[tuple[bytes, bytes]]:
    return [(name.lower().encode("latin-1"), str(value).encode("latin-1")) for name, value in response.items()]


async def _send(response, send) -> None:
    await send({"type": "http.response.start", "status": response.status_code, "headers": _headers(response)})
    if isinstance(response, StreamingHttpResponse):
        await _send_chunks(response.streaming_content, send)
    else:
        await send({"type": "http.response.body", "body": response.content})


async def _send_chunks(chunks: AsyncIterator[bytes], send) -> None:
    """A streaming response's chunks (`relay._sse`'s, under Django's response), each as it comes; the stream's end
    ([DONE]) ends the response at once, and the iterator is read on to its own end after it (its hold settled while
    the client has its whole answer)."""
    ended = False
    async for chunk in chunks:
        if ended:  # nothing follows the response's end
            continue
        ended = chunk.endswith(DONE)
        await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
    if not ended:
        await send({"type": "http.response.body", "body": b""})


async def _send_stream(body: relay.SseBody, send, cycle=None, start: dict | None = None) -> None:
    """A stream's SSE body, its writes as the engine's events arrive (`SseBody.take`). The write that ends the stream
    ([DONE]) ends the response at once: the hold is settled after it, while the client has its whole answer (the
    body is read on to its own end first: the engine's response, then nothing that reaches the client). A failure of
    the body settles it first. With `start`, the head leaves in the server's `cycle`'s write of the first chunk."""
    ended = False  # the response's end was sent
    while not body.ended:
        try:
            if body.waiting:
                await body.arrival()
            writes = body.take()
        except BaseException:
            await body.exchange.settle()  # not cancelled by the client's going meanwhile (`exchange.settling`)
            if start is not None:
                await send(start)
            raise
        for chunk in writes:
            if ended:
                continue
            ended = chunk.endswith(DONE)
            if start is not None:
                await cycle.start_with_body(start, {"type": "http.response.body", "body": chunk, "more_body": not ended})
                start = None
            elif cycle is None or not cycle.write_now(chunk, not ended):  # the server's send, without its coroutine
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
    await body.exchange.settle()
    if start is not None:  # nothing was written
        await send(start)
    if not ended and (cycle is None or not cycle.write_now(b"", False)):
        await send({"type": "http.response.body", "body": b""})


_https = SecurityMiddleware(lambda request: None)  # the platform's HTTPS policy (redirect, HSTS, nosniff)


class HttpsPolicy:
    """What `middleware` (Django's SecurityMiddleware) decides for a request, read from the ASGI scope as Django's
    request would (`is_secure`: the scheme, or SECURE_PROXY_SSL_HEADER's first value when the header is there) and
    the headers it adds to an answer, for the fast path that builds no Django request or response."""

    def __init__(self, middleware: SecurityMiddleware):
        self.middleware = middleware
        self.redirect = bool(middleware.redirect)  # its settings are read once, when it is made
        self.proxy_header: tuple[bytes, str] | None = None
        if hot.SECURE_PROXY_SSL_HEADER:
            meta_name, secure_value = hot.SECURE_PROXY_SSL_HEADER
            self.proxy_header = (meta_name.removeprefix("HTTP_").lower().replace("_", "-").encode("latin-1"),
                                 secure_value)  # fmt: skip
        self.added = {secure: self._headers_added(secure) for secure in (False, True)}  # the headers it adds, by `secure`

    def secure(self, scope) -> bool:
        if self.proxy_header is not None:
            name, secure_value = self.proxy_header
            values = [value for header, value in scope["headers"] if header.lower() == name]
            if values:
                first = b",".join(values).decode("latin-1").split(",", 1)[0]
                return first.strip() == secure_value
        return (scope.get("scheme") or "http") == "https"

    def redirects(self, *, secure: bool) -> bool:
        """Whether the middleware may answer this request itself (a redirect to HTTPS); if so, the request takes
        the general path, where the middleware decides (exempt paths included)."""
        return self.redirect and not secure

    def _headers_added(self, secure: bool) -> list[tuple[bytes, bytes]]:
        request = SimpleNamespace(is_secure=lambda: secure)
        before = HttpResponse()
        names = set(before.headers)
        after = self.middleware.process_response(request, before)
        return [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in after.items()
                if name not in names]  # fmt: skip


_policy = HttpsPolicy(_https)


@functools.lru_cache(maxsize=1024)
def _route(path: str):
    """The URLconf's match for a path (walking the platform's URL patterns costs more than the rest of the routing;
    the URLconf does not change while the process runs). Resolver404 is raised, never cached."""
    return resolve(path)


async def _serve(request, send) -> None:
    try:
        response = _https.process_request(request)
        if response is None:
            match = _route(request.path_info)
            response = await match.func(request, *match.args, **match.kwargs)
    except Resolver404:
        response = _answered(ApiError(404, f"Unknown endpoint: {request.method} {request.path}", code="unknown_url"))
    except asyncio.CancelledError:
        raise
    except Exception as error:
        request_id = uuid.uuid4().hex
        response = _failed(error, method=request.method, path=request.path, request_id=request_id)
        response["x-request-id"] = request_id
    await _send(_https.process_response(request, response), send)


def _answered(error: ApiError):
    """An error answered here, before or around a view: with a request id, as the views' answers have."""
    response = error.response()
    response["x-request-id"] = uuid.uuid4().hex
    return response


def _failed(error: Exception, *, method: str, path: str, request_id: str) -> HttpResponse:
    """An unexpected failure around a view, logged, as the API's answer: 503 when a store is down, else 500."""
    if isinstance(error, STORE_DOWN):
        log.warning("the inference API could not reach a store on %s %s (request %s): %r", method, path, request_id,
                    error)  # fmt: skip
        return service_unavailable().response()
    log.error("the inference API failed on %s %s (request %s)", method, path, request_id, exc_info=error)
    return ApiError(500, "The server failed to handle this request.", code="internal_error").response()


COMPLETION_ROUTES = {PREFIX + "chat/completions": "chat", PREFIX + "completions": "completion"}
_LATIN1 = operator.methodcaller("encode", "latin-1")
_SSE_HEAD = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in relay.SSE_HEADERS.items()]


def _header(scope, name: bytes) -> str:
    """A request header as Django's request.META has it (repeated headers joined by commas, "" when absent)."""
    return b",".join([value for header, value in scope["headers"] if header.lower() == name]).decode("latin-1")


def _generation_headers(scope) -> tuple[str, str]:
    """The request's Content-Type and Authorization, as `_header` reads them: in one pass in C when no header name
    is repeated (ASGI servers give the names in lower case), else each by `_header`."""
    headers = scope["headers"]
    named = dict(headers)
    if len(named) != len(headers):
        return _header(scope, b"content-type"), _header(scope, b"authorization")
    return named.get(b"content-type", b"").decode("latin-1"), named.get(b"authorization", b"").decode("latin-1")


@functools.lru_cache(maxsize=64)
def _media_type(content_type: str) -> str:
    """The Content-Type's media type, as `parse_header_parameters` reads it (once per distinct header value)."""
    return parse_header_parameters(content_type)[0]


async def _generate(scope, raw: bytes, send, *, kind: str, secure: bool, received: float) -> None:
    """A chat or completion request, as `views.chat_completions`/`views.completions` answer it behind `_serve`,
    without Django's request and response objects when the answer is a stream: the same services in the same
    order, the same head (the SSE headers, the rate-limit headers, x-request-id, the HTTPS policy's) and body."""
    request_id = request_id_hex()
    method, path = scope["method"], scope["path"]
    content_type, authorization = _generation_headers(scope)
    try:
        try:
            exchange, headers = await views.generation_admit(
                kind=kind, raw=raw, content_type=_media_type(content_type), authorization=authorization,
                request_id=request_id, received=received,
            )  # fmt: skip
            if exchange.generation.stream:
                body = await relay.open_stream(exchange, headers)
            else:
                response = await relay.respond(exchange, headers)
        except ApiError as error:
            response, exchange = await views.error_response(error), None
    except asyncio.CancelledError:
        raise
    except Exception as error:
        response, exchange = _failed(error, method=method, path=path, request_id=request_id), None
    if exchange is None or not exchange.generation.stream:
        response["x-request-id"] = request_id
        await _send(_https.process_response(SimpleNamespace(is_secure=lambda: secure), response), send)
        return
    head = [*_SSE_HEAD, *zip(map(_LATIN1, headers), map(_LATIN1, headers.values()), strict=True),
            (b"x-request-id", request_id.encode()), *_policy.added[secure]]  # fmt: skip
    start = {"type": "http.response.start", "status": 200, "headers": head}
    try:
        cycle = scope.get("extensions", {}).get(EXTENSION)
        if cycle is None:
            await send(start)
            await _send_stream(body, send)
        else:  # the head leaves with the first chunk (the first event was read in open_stream: it is at hand)
            await _send_stream(body, send, cycle, start)
    except BaseException:
        if not exchange.settled:  # the body never ended (the client left while a chunk was sent): its hold is still owned
            await asyncio.shield(exchange.settle())
        raise


async def _metrics(scope, send) -> None:
    """The gateway's Prometheus metrics, to a scraper with the metrics token (404 when none is configured)."""
    authorization = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
    if not settings.QUILT_METRICS_TOKEN:
        status, body, kind = 404, b"Not found\n", "text/plain"
    elif not metrics.authorized(authorization):
        status, body, kind = 401, b"Unauthorized\n", "text/plain"
    else:
        body, kind = metrics.exposition()
        status = 200
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", kind.encode())]})
    await send({"type": "http.response.body", "body": body})


class InferenceFastPath:
    def __init__(self, platform):
        self.platform = platform
        # the hot routes, for the gateway's own server (`http_protocol.DirectCycle`): a POST to one goes to
        # `serve_direct` without ASGI's layers
        self.direct_routes = {route.encode("ascii"): kind for route, kind in COMPLETION_ROUTES.items()}

    async def serve_direct(self, cycle, kind: str) -> None:
        """A POST to a completion route from the gateway's own server, as `__call__` serves it: to `_generate` when
        its body is within the limit and no script prefix or HTTPS redirect applies; else `__call__` decides."""
        received, limit, signal = cycle.received, hot.QUILT_MAX_REQUEST_BYTES, cycle.message_event
        while cycle.more_body and len(cycle.body) <= limit and not cycle.disconnected:  # the body's rest, as sent
            cycle.flow.resume_reading()
            await signal.wait()
            signal.clear()
        if cycle.disconnected:
            return
        scope, body = cycle.scope, cycle.body
        secure = scope["scheme"] == "https" if _policy.proxy_header is None else _policy.secure(scope)
        if len(body) > limit or hot.FORCE_SCRIPT_NAME or (_policy.redirect and not secure):
            signal.set()  # what has arrived is the ASGI receive's first message
            await self(scope, cycle.receive, cycle.send)
            return
        cycle.body = b""
        await until_told_disconnected(_generate(scope, body, cycle.send, kind=kind, secure=secure, received=received),
                                      cycle)  # fmt: skip

    async def __call__(self, scope, receive, send) -> None:
        """The request: read whole, then served by `_generate` (a POST to a completion route, with no script prefix,
        that the HTTPS policy lets through: `fast`) or `_serve`, cancelled if its client goes away first."""
        received = time.monotonic()  # the request log's times start at the gateway's receipt of the request
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                await lifespan(receive, send)
            else:
                await self.platform(scope, receive, send)
            return
        path = scope["path"]
        if not path.startswith(PREFIX):
            if path == METRICS_PATH:
                await _metrics(scope, send)
            else:
                await self.platform(scope, receive, send)
            return
        method = scope["method"]
        limit = body_limit(method=method, path=path)
        try:  # `_read_body`, its first message read here (most bodies come whole in it)
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = b"".join((message.get("body", b""),))
            if len(body) > limit:
                raise _TooLarge
            if message.get("more_body", False):
                body = await _read_body(receive, limit, body)
                if body is None:
                    return
        except _TooLarge:
            refusal = too_large(limit)
            response = _answered(refusal)
            if method == "POST" and path in COMPLETION_ROUTES:  # answered before the key is read: logged anonymously
                request_reports.refused_anonymously(request_id=response["x-request-id"], error=refusal,
                                                    authorization=_header(scope, b"authorization"))  # fmt: skip
            await _send(response, send)  # the rest of the body is left unread: the server closes
            return
        kind = COMPLETION_ROUTES.get(path)
        if kind is not None and (method != "POST" or scope.get("root_path") or hot.FORCE_SCRIPT_NAME):
            kind = None
        if kind is not None:  # `_policy.secure` (where no proxy header is trusted) and `redirects` written out
            secure = scope.get("scheme") == "https" if _policy.proxy_header is None else _policy.secure(scope)
            if not (secure or not _policy.redirect):
                kind = None
        if kind is not None:
            serving = _generate(scope, body, send, kind=kind, secure=secure, received=received)
        else:
            request = ASGIRequest(scope, io.BytesIO(body))
            request.received = received
            serving = _serve(request, send)
        cycle = scope.get("extensions", {}).get(EXTENSION)
        if cycle is None:
            await until_disconnected(serving, receive)
        else:
            await until_told_disconnected(serving, cycle)


application = InferenceFastPath(platform_application)
gc.freeze()  # start-up's objects live as long as the process: no full collection walks them again
