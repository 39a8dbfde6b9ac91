"""Thin tasks: the engine sends `metering.ingest_usage` by name; beat runs `metering.rollup_usage`."""

import logging
from dataclasses import asdict

from celery import Task, shared_task
from django.db import InterfaceError, OperationalError
from redis.exceptions import ConnectionError as RedisConnectionError

from engine.contract import TASK_NAME
from metering.gateway_reports import gateway_reports_record
from metering.parking import usage_batch_park
from metering.rollups import usage_rollup_recent
from metering.services import request_bodies_purge, usage_ingest

logger = logging.getLogger(__name__)
TRANSIENT = (OperationalError, InterfaceError, ConnectionError, RedisConnectionError)


class IngestTask(Task):
    def on_failure(self, exc, task_id, args, kwargs, einfo) -> None:
        """Retries are spent or the error is not transient: park the batch rather than lose usage."""
        events = args[0] if args else kwargs.get("events", [])
        usage_batch_park(events=events, error=f"{type(exc).__name__}: {exc}", task_id=task_id)


@shared_task(
    base=IngestTask,
    name=TASK_NAME,
    autoretry_for=TRANSIENT,
    retry_backoff=True,
    retry_backoff_max=60,
    max_retries=8,
)
def ingest_usage(events: list[dict]) -> dict:
    return asdict(usage_ingest(events=events))


REPORT_RETRIES = 12  # the gateway's times wait about a minute for the engine's event of the same request
REPORT_RETRY_SECONDS = 5


@shared_task(name="metering.record_gateway_reports", bind=True, autoretry_for=TRANSIENT, retry_backoff=True,
             max_retries=8)  # fmt: skip
def record_gateway_reports(self, reports: list[dict], attempt: int = 0) -> dict:
    """The gateway's refusals and times (gateway.request_reports); times whose row is not there yet are tried again
    later in a task of their own, then dropped (the row keeps the engine's times)."""
    result = gateway_reports_record(reports=reports)
    if result.unmatched and attempt < REPORT_RETRIES:
        record_gateway_reports.apply_async(args=[result.unmatched, attempt + 1], countdown=REPORT_RETRY_SECONDS)
    elif result.unmatched:
        logger.warning("%d gateway reports found no request to go with; dropped", len(result.unmatched))
    return {"refusals": result.refusals, "answered": result.answered, "unmatched": len(result.unmatched)}


@shared_task(name="metering.rollup_usage", autoretry_for=TRANSIENT, retry_backoff=True, max_retries=3)
def rollup_usage() -> int:
    return usage_rollup_recent()


@shared_task(name="metering.purge_request_bodies", autoretry_for=TRANSIENT, retry_backoff=True, max_retries=5)
def purge_request_bodies() -> int:
    """Deletes the prompts and completions whose retention has passed (beat, hourly); idempotent."""
    return request_bodies_purge()
