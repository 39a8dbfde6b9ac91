"""The gateway's ASGI entry, served by uvicorn: `uvicorn gateway.asgi:application --app-dir platform --http httptools
--loop uvloop`.

The inference API (/v1/) is latency-critical: it is served straight from the ASGI scope, without Django's request
handler around it (which runs signal receivers and the response close in per-request threads, several milliseconds
under load) and without the console's middleware (sessions, CSRF, login lockout: none applies to bearer-key API
calls). Everything else is the platform's own application.

What Django's handler would do and this does too: read the body (413 past the limit), route by the URLconf, turn a
client disconnect (ASGI's `http.disconnect`) into cancelling the request (so its `finally` runs: the hold is
settled, the engine request aborted), and answer an unexpected error with a 500 in the API's error shape.

A POST to a generation route (chat, completions) goes to the generation chain (`gateway.generation.generate`) with
its body and headers, and its answer is written here with the head the view's response would have had (the HTTPS
policy's headers included); other methods, a script prefix, and requests the HTTPS policy redirects take the
general path, the URLconf's views (which reach the same chain).
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
from gateway.errors import ApiError
from gateway.openai_response import DONE
from gateway.request_guard import body_limit, too_large
from quilt.asgi import application as platform_application  # sets Django up

log = logging.getLogger(__name__)

from gateway import relay, request_reports  # noqa: E402 - they need Django set up
from gateway.disconnects import until_disconnected  # noqa: E402
from gateway.generation import Stream, failed, generate  # noqa: E402
from gateway.hot_settings import hot  # noqa: E402
from gateway.lifespan import lifespan  # noqa: E402

PREFIX = "/v1/"
METRICS_PATH = "/metrics"


class _TooLarge(Exception):
    pass


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole request body, or None if the client went away first; _TooLarge past `limit` bytes."""
    chunks, size = [], 0
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
    """A streaming response's chunks (`relay.sse`'s), each as it comes; the stream's end
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
    except Exception as error:  # a cancellation (the client gone) is not one
        request_id = uuid.uuid4().hex
        response = failed(error, method=request.method, path=request.path, request_id=request_id)
        response["x-request-id"] = request_id
    await _send(_https.process_response(request, response), send)


def _answered(error: ApiError):
    """An error answered here, before or around a view: with a request id, as the views' answers have."""
    response = error.response()
    response["x-request-id"] = uuid.uuid4().hex
    return response


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
    """A chat or completion request through the generation chain; its answer written with the head the views'
    response would have had behind Django's middleware (the SSE headers, the rate-limit headers, x-request-id, the
    HTTPS policy's)."""
    content_type, authorization = _generation_headers(scope)
    answer = await generate(kind=kind, raw=raw, content_type=_media_type(content_type), authorization=authorization,
                            received=received)  # fmt: skip
    if not isinstance(answer, Stream):
        await _send(_https.process_response(SimpleNamespace(is_secure=lambda: secure), answer), send)
        return
    head = [*_SSE_HEAD, *zip(map(_LATIN1, answer.headers), map(_LATIN1, answer.headers.values()), strict=True),
            (b"x-request-id", answer.request_id.encode()), *_policy.added[secure]]  # fmt: skip
    chunks = relay.sse(answer.body)
    try:
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await _send_chunks(chunks, send)
    finally:
        await chunks.aclose()  # a body left unread (the client gone while a chunk was sent) settles its hold here
        if not answer.body.exchange.settled:  # the client gone before the body's first chunk was read
            await asyncio.shield(answer.body.exchange.settle())


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

    async def __call__(self, scope, receive, send) -> None:
        """The request: read whole, then served by `_generate` (a POST to a generation route, with no script prefix,
        that the HTTPS policy lets through) or `_serve`, cancelled if its client goes away first."""
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
        try:
            body = await _read_body(receive, limit)
        except _TooLarge:
            refusal = too_large(limit)
            response = _answered(refusal)
            if method == "POST" and path in COMPLETION_ROUTES:  # answered before the key is read: logged anonymously
                request_reports.refused_anonymously(request_id=response["x-request-id"], error=refusal,
                                                    authorization=_header(scope, b"authorization"))  # fmt: skip
            await _send(response, send)  # the rest of the body is left unread: the server closes
            return
        if body is None:  # the client went away
            return
        kind = COMPLETION_ROUTES.get(path) if method == "POST" else None
        if kind is not None and not scope.get("root_path") and not hot.FORCE_SCRIPT_NAME:
            secure = _policy.secure(scope)
            if not _policy.redirects(secure=secure):
                await until_disconnected(_generate(scope, body, send, kind=kind, secure=secure, received=received),
                                         receive)  # fmt: skip
                return
        request = ASGIRequest(scope, io.BytesIO(body))
        request.received = received
        await until_disconnected(_serve(request, send), receive)


application = InferenceFastPath(platform_application)
gc.freeze()  # start-up's objects live as long as the process: no full collection walks them again
