"""The usage events the gateway makes itself, under the engine's request id (metering keeps the first event per id):
the one it sends when an engine died mid-request and so could not send its own, and the one it keeps with every
served request's provisional settle, billed if the engine's own event never arrives. Both are the engine's
UsageEvent, without the GPU and queue times only the engine knows."""

import msgspec

from engine.contract import TASK_NAME, UsageEvent

_encode = msgspec.json.Encoder().encode


def usage_json(event: UsageEvent) -> str:
    """The event as the provisional settle keeps it (JSON text), read back by metering as the engine's."""
    return _encode(event).decode()


def usage_send(event: UsageEvent) -> None:
    """Blocking (the broker): call through sync_to_async."""
    from quilt.celery import app

    app.send_task(TASK_NAME, args=[[msgspec.to_builtins(event)]])
