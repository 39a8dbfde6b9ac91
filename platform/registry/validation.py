"""Validating an uploaded version: uploaded -> validating -> ready | failed. Safe to run twice, or concurrently.

The claim (validating, attempt count, start time) commits before the work starts, so a worker that dies
mid-validation leaves a version the periodic sweep finds by its stale start time and queues again; after
QUILT_ADAPTER_VALIDATION_MAX_ATTEMPTS claims that never finished it fails with a message, never stuck.
"""

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

import adapters
from registry.broadcast import status_changed_on_commit
from registry.models import Adapter, AdapterVersion
from registry.promotion import promote_locked
from registry.storage import canonical_put, upload_delete, upload_source
from tenancy.audit import Actor

logger = logging.getLogger(__name__)
Status = AdapterVersion.Status
FINAL = (Status.READY, Status.FAILED)


def _locked(version_id: int) -> AdapterVersion:
    return AdapterVersion.objects.select_for_update(of=("self",)).select_related("adapter").get(pk=version_id)


def _fail_locked(version: AdapterVersion, *, code: str, message: str) -> None:
    version.status = Status.FAILED
    version.failure_code = code
    version.failure_message = message
    version.validated_at = timezone.now()
    upload_key, version.upload_key = version.upload_key, ""
    version.save(update_fields=["status", "failure_code", "failure_message", "validated_at", "upload_key"])
    status_changed_on_commit(version)
    transaction.on_commit(lambda: upload_delete(key=upload_key), robust=True)


def _claim(version_id: int) -> AdapterVersion | None:
    """Marks the version validating (one more attempt); None when there is nothing left to do."""
    with transaction.atomic():
        version = _locked(version_id)
        if version.status in FINAL:
            return None
        if version.adapter.deleted_at is not None:
            _fail_locked(version, code="adapter_deleted", message="The adapter was deleted before validation ran.")
            return None
        attempts = settings.QUILT_ADAPTER_VALIDATION_MAX_ATTEMPTS
        if version.validation_attempts >= attempts:
            _fail_locked(
                version, code="validation_interrupted",
                message=f"Validation was interrupted {attempts} times before it could finish (the worker stopped "
                "or ran out of memory). Upload the adapter again; if it keeps happening, contact support.",
            )  # fmt: skip
            return None
        version.status = Status.VALIDATING
        version.validation_attempts += 1
        version.validation_started_at = timezone.now()
        version.save(update_fields=["status", "validation_attempts", "validation_started_at"])
        status_changed_on_commit(version)
    return version


def _finish_failed(version_id: int, *, code: str, message: str) -> AdapterVersion:
    with transaction.atomic():
        version = _locked(version_id)
        if version.status not in FINAL:
            _fail_locked(version, code=code, message=message)
    return version


def _finish_ready(version_id: int, *, loaded: "adapters.LoadedAdapter", storage_key: str) -> AdapterVersion:
    with transaction.atomic():
        version = _locked(version_id)
        if version.status in FINAL:
            return version
        upload_key = version.upload_key
        version.status = Status.READY
        version.digest = loaded.digest
        version.storage_key = storage_key
        version.rank = loaded.rank
        version.alpha = loaded.alpha
        version.target_modules = list(loaded.target_modules)
        version.num_bytes = loaded.num_bytes
        version.validated_at = timezone.now()
        version.upload_key = ""
        version.save()
        status_changed_on_commit(version)
        transaction.on_commit(lambda: upload_delete(key=upload_key), robust=True)
        adapter = Adapter.objects.select_for_update().get(pk=version.adapter_id)
        if adapter.current_version_id is None and adapter.deleted_at is None:
            promote_locked(actor=Actor.system(), adapter=adapter, version=version, automatic=True)
    return version


def adapter_version_validate(*, version_id: int) -> AdapterVersion:
    """Validates against the base model with `adapters.load_adapter` and stores the canonical form."""
    version = _claim(version_id)
    if version is None:
        return AdapterVersion.objects.get(pk=version_id)
    base_config = version.adapter.base_model.config
    try:
        with upload_source(key=version.upload_key) as source:
            loaded = adapters.load_adapter(source, base_config, max_rank=settings.QUILT_ADAPTER_MAX_RANK)
        storage_key = canonical_put(adapter=loaded)
    except adapters.AdapterError as error:
        return _finish_failed(version_id, code=error.code, message=error.message)
    except FileNotFoundError:
        logger.warning("upload of adapter version %s is missing from storage", version_id)
        return _finish_failed(
            version_id, code="upload_missing", message="The uploaded files are no longer stored; upload again."
        )
    return _finish_ready(version_id, loaded=loaded, storage_key=storage_key)


def adapter_versions_stale(*, older_than: timedelta) -> QuerySet[AdapterVersion]:
    """Versions whose validation never started or never finished within `older_than`."""
    cutoff = timezone.now() - older_than
    return AdapterVersion.objects.filter(
        Q(status=Status.UPLOADED, created_at__lt=cutoff)
        | Q(status=Status.VALIDATING, validation_started_at__lt=cutoff)
    ).order_by("id")
