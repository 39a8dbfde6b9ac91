"""The gateway's ASGI entry: `uvicorn gateway.asgi:application --app-dir platform`.

The inference API (/v1/) is latency-critical: its async views are called straight from the ASGI scope, without
Django's request handler around them (which runs signal receivers and the response close in per-request
threads, several milliseconds under load) and without the console's middleware (sessions, CSRF, login
lockout: none applies to bearer-key API calls). Everything else is the platform's own application.

What Django's handler would do and this does too: read the body, route by the URLconf, turn a client
disconnect into cancelling the view (so its `finally` runs: the hold is settled, the engine request aborted),
and answer an unexpected error with a 500 in the API's error shape.
"""

import asyncio
import contextlib
import functools
import io
import logging
import uuid

from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.http import StreamingHttpResponse
from django.middleware.security import SecurityMiddleware
from django.urls import Resolver404, resolve
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway import metrics
from gateway.connections import DATABASE_DOWN
from gateway.errors import ApiError, service_unavailable
from gateway.openai_response import DONE
from gateway.request_guard import body_limit, too_large
from quilt.asgi import application as platform_application  # sets Django up

log = logging.getLogger(__name__)
PREFIX = "/v1/"
METRICS_PATH = "/metrics"
STORE_DOWN = (*DATABASE_DOWN, RedisConnectionError, RedisTimeoutError)


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


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _headers(response) -> list[tuple[bytes, bytes]]:
    return [(name.lower().encode("latin-1"), str(value).encode("latin-1")) for name, value in response.items()]


async def _send(response, send) -> None:
    await send({"type": "http.response.start", "status": response.status_code, "headers": _headers(response)})
    if isinstance(response, StreamingHttpResponse):
        last = b""
        try:
            async for chunk in response.streaming_content:
                if last:
                    await send({"type": "http.response.body", "body": last, "more_body": True})
                    last = b""
                if chunk.endswith(DONE):  # the stream's end leaves with the response's end (one write), once the
                    last = chunk  # generator has finished (its hold settled), as the response's end did before
                else:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except Exception:
            if last:  # the generator failed after its end (settling): the client still gets what it was sent before
                await send({"type": "http.response.body", "body": last, "more_body": True})
            raise
        await send({"type": "http.response.body", "body": last})
    else:
        await send({"type": "http.response.body", "body": response.content})


_https = SecurityMiddleware(lambda request: None)  # the platform's HTTPS policy (redirect, HSTS, nosniff)


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
    except STORE_DOWN as error:
        response = _answered(service_unavailable())
        log.warning("the inference API could not reach a store on %s %s (request %s): %r", request.method,
                    request.path, response["x-request-id"], error)  # fmt: skip
    except Exception:
        response = _answered(ApiError(500, "The server failed to handle this request.", code="internal_error"))
        log.exception("the inference API failed on %s %s (request %s)", request.method, request.path,
                      response["x-request-id"])  # fmt: skip
    await _send(_https.process_response(request, response), send)


def _answered(error: ApiError):
    """An error answered here, before or around a view: with a request id, as the views' answers have."""
    response = error.response()
    response["x-request-id"] = uuid.uuid4().hex
    return response


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
        if scope["type"] == "http" and scope["path"] == METRICS_PATH:
            await _metrics(scope, send)
            return
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            await self.platform(scope, receive, send)
            return
        limit = body_limit(method=scope["method"], path=scope["path"])
        try:
            body = await _read_body(receive, limit)
        except _TooLarge:
            await _send(_answered(too_large(limit)), send)  # the rest of the body is left unread: the server closes
            return
        if body is None:
            return
        request = ASGIRequest(scope, io.BytesIO(body))
        serving = asyncio.create_task(_serve(request, send))
        listening = asyncio.create_task(_disconnected(receive))
        try:
            await asyncio.wait({serving, listening}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            listening.cancel()
            if not serving.done():
                serving.cancel()  # the client went away: the view's `finally` settles and aborts
            with contextlib.suppress(asyncio.CancelledError):
                await serving


application = InferenceFastPath(platform_application)
