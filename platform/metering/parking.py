"""Batches that ingest failed on for good are parked in the database instead of being dropped, and replayed."""

import logging

from django.utils import timezone

from metering.models import ParkedUsageBatch
from metering.services import usage_ingest

logger = logging.getLogger(__name__)


def usage_batch_park(*, events: list, error: str, task_id: str = "") -> ParkedUsageBatch:
    logger.error("usage batch of %d events parked after %s", len(events), error)
    return ParkedUsageBatch.objects.create(events=events, error=error[:10_000], task_id=task_id)


def usage_batches_replay() -> tuple[int, int]:
    """Ingests every parked batch again; returns (replayed, still failing). A failure stays parked, with its error."""
    replayed = failing = 0
    for batch in ParkedUsageBatch.objects.filter(replayed_at__isnull=True).order_by("pk"):
        try:
            usage_ingest(events=batch.events)
        except Exception as error:  # kept parked with the new error; the operator sees it in the admin
            batch.error = f"{type(error).__name__}: {error}"[:10_000]
            batch.save(update_fields=["error"])
            failing += 1
            continue
        batch.replayed_at = timezone.now()
        batch.save(update_fields=["replayed_at"])
        replayed += 1
    return replayed, failing
