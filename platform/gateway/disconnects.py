"""A request cancelled when its client goes away (ASGI's `http.disconnect`), and then ending normally (its `finally`
settles the hold and aborts the engine request), unless it is settling its hold, which then finishes."""

import asyncio
from collections.abc import Coroutine

from gateway.exchange import settling as exchange_settling


async def until_disconnected(serving: Coroutine, receive) -> None:
    """Runs `serving` in this (the server's) task, cancelled if the client goes away first (the request's `finally`
    then settles and aborts), and then ends normally; a cancellation from elsewhere (the server's) still ends the task
    cancelled. One listener task beside it awaits the server's `receive()` for the disconnect."""
    task = asyncio.current_task()
    left: list[bool] = []
    listening = asyncio.create_task(_cancel_when_gone(receive, task, left))
    try:
        await serving
    except asyncio.CancelledError:
        if not left:
            raise  # not the client's going: the server's own cancellation
    finally:
        listening.cancel()
        if left:
            task.uncancel()  # the cancellation was this function's own, and is handled


async def _cancel_when_gone(receive, task: asyncio.Task, left: list[bool]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    _cancel(task, left)


def _cancel(task: asyncio.Task, left: list[bool]) -> None:
    """The client went away: its request is cancelled, unless it is settling its hold (which then finishes)."""
    if not task.done() and not exchange_settling(task):
        left.append(True)
        task.cancel()
