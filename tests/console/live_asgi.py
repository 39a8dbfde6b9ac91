"""The application the browser tests' ASGI server runs: Quilt's own, with a count of the work in flight and one
extra path, DRAIN_PATH, that answers once none is left. A test's teardown asks it before the test database is
flushed, so the flush's TRUNCATE never meets a lock held by a request or socket the test started.

Two counts, because one is not enough: the ASGI calls (a request from its first byte, a websocket from its
connect to its close) and the Django views still running in their thread. A client that disconnects cancels the
ASGI call, not the thread that runs the view, which goes on with its queries after the call has returned."""

import asyncio
import functools
import json
import threading
import time

from asgiref.sync import iscoroutinefunction
from django.utils.decorators import sync_and_async_middleware

DRAIN_PATH = "/__live__/drain"
DRAIN_TIMEOUT_S = 60.0


class Counter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def __enter__(self) -> None:
        with self._lock:
            self.value += 1

    def __exit__(self, *exc_info) -> None:
        with self._lock:
            self.value -= 1


asgi_calls = Counter()
views_running = Counter()


@sync_and_async_middleware
def count_running_views(get_response):
    """The outermost middleware of the test server (see server_settings)."""
    if iscoroutinefunction(get_response):

        async def middleware(request):
            with views_running:
                return await get_response(request)

    else:

        def middleware(request):
            with views_running:
                return get_response(request)

    return middleware


async def drain(send) -> None:
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while (asgi_calls.value or views_running.value) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    left = {"asgi_calls": asgi_calls.value, "views_running": views_running.value}
    body = json.dumps(left).encode()
    status = 503 if any(left.values()) else 200
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


@functools.cache
def quilt_application():
    # Imported on first use: the test process imports this module for DRAIN_PATH and must not build a server.
    from quilt.asgi import application

    return application


async def application(scope, receive, send):
    if scope["type"] == "http" and scope["path"] == DRAIN_PATH:
        await drain(send)
        return
    if scope["type"] not in ("http", "websocket"):
        await quilt_application()(scope, receive, send)
        return
    with asgi_calls:
        await quilt_application()(scope, receive, send)
