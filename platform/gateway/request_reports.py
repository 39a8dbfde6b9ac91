"""What the gateway itself reports to the request log, off the request path: each refusal (a request it answered
without an engine generating: 400, 403, 404, 429, 503 ...) and, for each request an engine took, the status it
answered and its own times from its receipt of the request (time to first token, end to end).

A request only appends its report to a queue (a microsecond); a daemon thread sends what gathered as one Celery
task, `metering.record_gateway_reports`, at most every FLUSH_SECONDS. So no request waits on the broker or the
database for its report, and the broker sees one message per flush, not one per request. What a gateway that dies
had not flushed yet (under a second) is lost: a refusal's row, or the gateway's times of a request, whose row then
keeps the engine's times (status_code stays null, which the log shows). Usage is never at stake here: the engines
report what they served, and refusals cost nothing.
"""

import atexit
import logging
import queue
import threading
import time
from datetime import UTC, datetime

from gateway.caller import Caller, Target, presented_key_prefix
from gateway.errors import ApiError

log = logging.getLogger(__name__)

TASK = "metering.record_gateway_reports"
FLUSH_SECONDS = 0.5
MAX_BATCH = 2000

_queue: queue.SimpleQueue = queue.SimpleQueue()
_started = threading.Lock()
_thread: threading.Thread | None = None


def refused(
    *, request_id: str, caller: Caller, error: ApiError, model: object, target: Target | None
) -> None:
    """A request the gateway answered with `error` before any engine generated for it."""
    _put({
        "kind": "refused", "request_id": request_id, "tenant_id": caller.tenant_id, "api_key_id": str(caller.key_id),
        "key_prefix": caller.limits.key_prefix, "model": model if isinstance(model, str) else "",
        "base_model": target.base_model if target is not None else "",
        "adapter_version_id": target.adapter_version_id if target is not None else None,
        "status_code": error.status, "error_code": error.code or "", "error": error.message,
        "finished_at": datetime.now(UTC).isoformat(),
    })  # fmt: skip


def refused_anonymously(*, request_id: str, error: ApiError, authorization: str, model: object = None) -> None:
    """A request refused before a key let it in (no key, a wrong one, a body past the limit read before the key): no
    tenant's, so an anonymous refusal in the staff's log, with the prefix of the key it presented (never its secret)."""
    _put({
        "kind": "refused", "request_id": request_id, "tenant_id": None, "api_key_id": "",
        "key_prefix": presented_key_prefix(authorization), "model": model if isinstance(model, str) else "",
        "base_model": "", "adapter_version_id": None, "status_code": error.status, "error_code": error.code or "",
        "error": error.message, "finished_at": datetime.now(UTC).isoformat(),
    })  # fmt: skip


def answered(*, request_id: str, status_code: int, received: float, first_token: float | None) -> None:
    """A request an engine took: the status the gateway answered and its times from its receipt of the request."""
    ttft_ms = round((first_token - received) * 1000.0, 3) if first_token is not None else None
    _put({"kind": "answered", "request_id": request_id, "status_code": status_code, "ttft_ms": ttft_ms,
          "e2e_ms": round((time.monotonic() - received) * 1000.0, 3)})  # fmt: skip


def _put(report: dict) -> None:
    _queue.put(report)
    if _thread is None:
        _start()


def _start() -> None:
    global _thread
    with _started:
        if _thread is None:
            _thread = threading.Thread(target=_run, name="gateway-request-reports", daemon=True)
            _thread.start()
            atexit.register(flush)


def _run() -> None:
    while True:
        batch = [_queue.get()]
        time.sleep(FLUSH_SECONDS)  # what arrives meanwhile leaves with it
        _send(batch + _drain())


def _drain() -> list[dict]:
    batch = []
    while len(batch) < MAX_BATCH:
        try:
            batch.append(_queue.get_nowait())
        except queue.Empty:
            break
    return batch


def flush() -> None:
    """Sends what is queued now (at exit, and for tests that read the log at once)."""
    batch = _drain()
    if batch:
        _send(batch)


def _send(batch: list[dict]) -> None:
    from quilt.celery import app

    for start in range(0, len(batch), MAX_BATCH):
        try:
            app.send_task(TASK, args=[batch[start : start + MAX_BATCH]])
        except Exception:  # the broker is away: the log loses these reports, the answers were given
            log.exception("could not send %d request reports to the log", len(batch[start : start + MAX_BATCH]))
