"""Sends usage events to the Celery broker in small batches, spooling to disk while it is away.

`emit()` never blocks the caller: events go to a background thread that batches them, publishes
`metering.ingest_usage` by name (the engine imports Celery, never Django), and on any broker
failure appends the batch to the spool. The spool is drained whenever the broker answers again,
and on start, so events spooled before a crash are sent by the next process. With no broker
configured (a development engine), events only go to the spool.
"""

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

from celery import Celery
from kombu.exceptions import OperationalError
from redis.exceptions import RedisError

from engine.usage.event import TASK_NAME, UsageEvent
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
        self.spooled = 0
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

    def emit(self, event: UsageEvent) -> None:
        self._events.put(event.to_dict())

    def close(self, *, timeout_s: float = 10.0) -> None:
        """Send (or spool) everything emitted so far, then stop the thread."""
        if self._thread.is_alive():
            self._events.put(_STOP)
            self._thread.join(timeout_s)

    def _run(self) -> None:
        if self._app is None:
            log.warning("no usage broker configured: usage events go to %s only", self.spool.path)
        else:
            self._drain_spool()
        stopping = False
        while not stopping:
            batch, stopping = self._next_batch()
            if self._app is not None and self.spool.has_pending() and time.monotonic() >= self._next_retry:
                self._drain_spool()
            if batch:
                try:
                    self._deliver(batch, last_chance=stopping)
                except Exception:  # a bug must not stop delivery of later events, nor lose this batch
                    log.exception("usage delivery failed; spooling the batch")
                    self.spool.append(batch)
                    self.spooled += len(batch)

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

    def _deliver(self, batch: list[dict[str, Any]], *, last_chance: bool) -> None:
        ready = not self.spool.has_pending() and (self.broker_up or time.monotonic() >= self._next_retry)
        if self._app is not None and (ready or last_chance) and self._try_send(batch):
            return
        self.spool.append(batch)
        self.spooled += len(batch)
        if self._app is not None:
            log.warning("broker unreachable: spooled %d usage events to %s", len(batch), self.spool.path)

    def _drain_spool(self) -> None:
        try:
            count = self.spool.drain(self._send, batch_size=self.batch_size)
        except BROKER_ERRORS as error:
            self._broker_down(error)
            return
        if count:
            log.info("re-sent %d spooled usage events", count)
        self.broker_up = True

    def _try_send(self, batch: list[dict[str, Any]]) -> bool:
        try:
            self._send(batch)
        except BROKER_ERRORS as error:
            self._broker_down(error)
            return False
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
            log.warning("usage broker unreachable (%s); spooling until it returns", error)
        self.broker_up = False
        self._next_retry = time.monotonic() + self.retry_interval_s
