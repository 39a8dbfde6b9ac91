"""Delivers usage events to the Celery broker, durably: `emit()` writes the event to the spool's write-ahead log
before it returns (the server sends the request's final event only after), and a background thread batches
events, publishes `metering.ingest_usage` by name (the engine imports Celery, never Django) and acknowledges
them in the log once the broker took them. Whatever the broker did not take (it was down, or this process was
killed) stays pending in the log and is re-sent when the broker answers again, and on start by the next
process. With no broker configured (a development engine), events only go to the log.
"""

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
from celery import Celery
from kombu.exceptions import OperationalError
from redis.exceptions import RedisError

from engine.contract.usage import TASK_NAME, UsageEvent
from engine.usage.spool import UsageSpool

log = logging.getLogger(__name__)

BROKER_ERRORS = (OperationalError, RedisError, OSError)
_STOP = object()


class UsageEmitter:
    def __init__(
        self,
        *,
        broker_url: str | None,
        spool_path: str | Path,
        batch_size: int = 32,
        flush_interval_s: float = 0.2,
        retry_interval_s: float = 2.0,
        connect_timeout_s: float = 2.0,
        queue_name: str | None = None,
    ) -> None:
        self.spool = UsageSpool(spool_path)
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.retry_interval_s = retry_interval_s
        self.queue_name = queue_name
        self.sent = 0
        self.broker_up = broker_url is not None
        self._app: Celery | None = None
        if broker_url is not None:
            self._app = Celery("quilt-engine-usage", broker=broker_url, set_as_current=False)
            self._app.conf.broker_connection_timeout = connect_timeout_s
            options: dict[str, Any] = {"max_retries": 0}
            if broker_url.startswith(("redis://", "rediss://")):
                # Only redis-py takes socket timeouts; the embedded SQLAlchemy broker refuses unknown options.
                options |= {"socket_connect_timeout": connect_timeout_s, "socket_timeout": connect_timeout_s}
            self._app.conf.broker_transport_options = options
        self._events: queue.Queue = queue.Queue()
        self._next_retry = 0.0
        self._thread = threading.Thread(target=self._run, name="usage-emitter", daemon=True)

    def start(self) -> "UsageEmitter":
        self._thread.start()
        return self

    @property
    def spooled(self) -> int:
        """Events in the log the broker has not taken yet."""
        return self.spool.pending_count()

    def emit(self, event: UsageEvent) -> None:
        """Logs the event (it survives this process being killed from now on), then queues it for delivery."""
        data = msgspec.to_builtins(event)
        self.spool.record(data)
        self._events.put(data)

    def close(self, *, timeout_s: float = 10.0) -> None:
        """Send (or keep in the log) everything emitted so far, then stop the thread."""
        if self._thread.is_alive():
            self._events.put(_STOP)
            self._thread.join(timeout_s)

    def _run(self) -> None:
        if self._app is None:
            log.warning("no usage broker configured: usage events go to %s only", self.spool.path)
        else:
            self._resend_pending()
        stopping = False
        while not stopping:
            batch, stopping = self._next_batch()
            self.spool.sync()
            if self._app is None:
                continue
            if not self.broker_up and (time.monotonic() >= self._next_retry or stopping):
                self._resend_pending()  # includes this batch: it is in the log
                continue
            batch = [event for event in batch if self.spool.is_pending(event["request_id"])]
            if batch:
                self._try_send(batch)

    def _next_batch(self) -> tuple[list[dict[str, Any]], bool]:
        batch: list[dict[str, Any]] = []
        deadline = time.monotonic() + self.flush_interval_s
        while len(batch) < self.batch_size:
            try:
                item = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is _STOP:
                return batch, True
            batch.append(item)
        return batch, False

    def _resend_pending(self) -> None:
        pending = self.spool.pending()
        for start in range(0, len(pending), self.batch_size):
            if not self._try_send(pending[start : start + self.batch_size]):
                return
        if pending:
            log.info("re-sent %d usage events from the log", len(pending))

    def _try_send(self, batch: list[dict[str, Any]]) -> bool:
        try:
            self._send(batch)
        except BROKER_ERRORS as error:
            self._broker_down(error)
            return False
        except Exception:  # a bug must not stop delivery of later events; the batch stays in the log
            log.exception("usage delivery failed; the batch stays in the log")
            self._broker_down(RuntimeError("delivery failed"))
            return False
        self.spool.acknowledge([event["request_id"] for event in batch])
        self.broker_up = True
        return True

    def _send(self, batch: list[dict[str, Any]]) -> None:
        assert self._app is not None
        options = {"queue": self.queue_name} if self.queue_name else {}
        with self._app.connection_for_write() as connection:  # a fresh one: no stale pooled socket after an outage
            self._app.send_task(TASK_NAME, args=[batch], connection=connection, retry=False, **options)
        self.sent += len(batch)

    def _broker_down(self, error: Exception) -> None:
        if self.broker_up:
            log.warning("usage broker unreachable (%s); events wait in %s until it returns", error, self.spool.path)
        self.broker_up = False
        self._next_retry = time.monotonic() + self.retry_interval_s
