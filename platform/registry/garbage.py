"""Garbage collection of blobs: canonical forms no live version references, and uploads no version waits on.

A blob changed within the grace period is kept, so one being written (or just shared by a new upload)
is never collected before the version that references it commits; the blobs of an adapter deleted within
the grace period are kept too, for engines still serving the requests that started before.
"""

import logging
from datetime import datetime, timedelta

from django.db.models import Q
from django.utils import timezone

from registry.models import AdapterVersion
from registry.storage import canonical_delete, stored_canonical_digests, stored_uploads, upload_delete

logger = logging.getLogger(__name__)


def _old(changed: datetime | None, cutoff: datetime) -> bool:
    return changed is None or changed < cutoff


def adapter_blobs_collect(*, grace: timedelta) -> dict[str, list[str]]:
    """Deletes unreferenced blobs older than `grace`; returns what went, by kind."""
    cutoff = timezone.now() - grace
    live = AdapterVersion.objects.filter(Q(adapter__deleted_at__isnull=True) | Q(adapter__deleted_at__gt=cutoff))
    digests = set(live.exclude(digest="").values_list("digest", flat=True))
    uploads = set(AdapterVersion.objects.exclude(upload_key="").values_list("upload_key", flat=True))
    removed: dict[str, list[str]] = {"canonical": [], "uploads": []}
    for digest, changed in stored_canonical_digests().items():
        if digest not in digests and _old(changed, cutoff):
            canonical_delete(digest=digest)
            removed["canonical"].append(digest)
    for key, changed in stored_uploads().items():
        if key not in uploads and _old(changed, cutoff):
            upload_delete(key=key)
            removed["uploads"].append(key)
    if removed["canonical"] or removed["uploads"]:
        logger.info("collected adapter blobs: %s", removed)
    return removed
