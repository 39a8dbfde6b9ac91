"""A request cancelled when its client goes away, and then ending normally (its `finally` settles the hold and
aborts the engine request), unless it is settling its hold, which then finishes. Under the gateway's own server
(`gateway/http_protocol.py`) the server says when the client went away; under another, a listener task awaits
`http.disconnect`."""

import asyncio
from collections.abc import Coroutine

from gateway.exchange import settling as exchange_settling
from gateway.http_protocol import GatewayCycle


async def until_disconnected(serving: Coroutine, receive) -> None:
    """Runs `serving` in this (the server's) task, cancelled if the client goes away first (the view's `finally` then
    settles and aborts), and then ends normally; a cancellation from elsewhere (the server's) still ends the task
    cancelled. One listener task beside it: not a second task for `serving` and an `asyncio.wait` over both (about
    30 Python calls per request less, docs/gateway-performance.md)."""
    task = asyncio.current_task()
    left: list[bool] = []
    # the loop's own create_task: asyncio.create_task's wrapper asks for the running loop (a getpid)
    listening = task.get_loop().create_task(_cancel_when_gone(receive, task, left))
    try:
        await serving
    except asyncio.CancelledError:
        if not left:
            raise  # not the client's going: the server's own cancellation
    finally:
        listening.cancel()
        if left:
            task.uncancel()  # the cancellation was this function's own, and is handled


async def until_told_disconnected(serving: Coroutine, cycle: GatewayCycle) -> None:
    """`until_disconnected` under the gateway's own server, which says when the client went away: no listener."""
    task = cycle.current_task()
    left: list[bool] = []
    cycle.when_disconnected(lambda: _cancel(task, left))
    try:
        await serving
    except asyncio.CancelledError:
        if not left:
            raise
    finally:
        cycle.when_disconnected(None)
        if left:
            task.uncancel()


async def _cancel_when_gone(receive, task: asyncio.Task, left: list[bool]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    _cancel(task, left)


def _cancel(task: asyncio.Task, left: list[bool]) -> None:
    """The client went away: its request is cancelled, unless it is settling its hold (which then finishes)."""
    if not task.done() and not exchange_settling(task):
        left.append(True)
        task.cancel()
