"""Telling billing that admission refused a request on a monthly limit, so that the limit's 100% alert goes out
(usage itself stops short of 100%: admission refuses the request that would pass it). At most once a minute per
tenant, limit and gateway process; by task name, so the gateway does not import billing."""

import asyncio
import logging
import time
from datetime import UTC, datetime

from asgiref.sync import sync_to_async

log = logging.getLogger(__name__)

TASK_NAME = "billing.check_budget_alerts"
EVERY_SECONDS = 60.0
KINDS = {"budget_tokens": "tokens", "budget_spend": "spend"}

_last_sent: dict[tuple[int, str], float] = {}
_in_flight: set[asyncio.Task] = set()


def _send(tenant_id: int, month: str, kind: str) -> None:
    from quilt.celery import app

    try:
        app.send_task(TASK_NAME, args=[tenant_id, month, kind])
    except Exception:  # the broker is away: the next refusal a minute later tries again
        log.exception("could not send the budget notice of tenant %s", tenant_id)
        _last_sent.pop((tenant_id, kind), None)


def budget_exhausted(*, tenant_id: int, reason: str) -> None:
    """Called on a refusal; sends the notice in the background (never delays the refusal)."""
    kind = KINDS.get(reason)
    if kind is None:
        return
    now = time.monotonic()
    if now - _last_sent.get((tenant_id, kind), -EVERY_SECONDS) < EVERY_SECONDS:
        return
    _last_sent[(tenant_id, kind)] = now
    month = datetime.now(UTC).date().replace(day=1).isoformat()
    task = asyncio.ensure_future(sync_to_async(_send, thread_sensitive=False)(tenant_id, month, kind))
    _in_flight.add(task)
    task.add_done_callback(_in_flight.discard)
