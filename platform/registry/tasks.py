"""Celery tasks: thin and idempotent (fetch by id, call the service). Late acks, so a lost worker's task returns."""

from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.db import OperationalError

from registry.garbage import adapter_blobs_collect
from registry.models import AdapterVersion
from registry.validation import adapter_version_validate, adapter_versions_stale


@shared_task(
    name="registry.validate_adapter_version", acks_late=True, reject_on_worker_lost=True,
    autoretry_for=(OperationalError, OSError), retry_backoff=True, max_retries=5,
)  # fmt: skip
def validate_adapter_version(version_id: int) -> str:
    try:
        return adapter_version_validate(version_id=version_id).status
    except AdapterVersion.DoesNotExist:
        return "gone"


@shared_task(name="registry.requeue_stale_validations")
def requeue_stale_validations() -> list[int]:
    """Queues again every validation that never started or never finished within the lease."""
    lease = timedelta(seconds=settings.QUILT_ADAPTER_VALIDATION_LEASE_SECONDS)
    stale = list(adapter_versions_stale(older_than=lease).values_list("id", flat=True))
    for version_id in stale:
        validate_adapter_version.delay(version_id)
    return stale


@shared_task(name="registry.collect_adapter_blobs")
def collect_adapter_blobs() -> dict[str, list[str]]:
    return adapter_blobs_collect(grace=timedelta(seconds=settings.QUILT_ADAPTER_GC_GRACE_SECONDS))
