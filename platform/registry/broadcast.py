"""On-commit side effects of registry changes: the tenant's Channels group and the registry signals."""

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

from registry.models import Adapter, AdapterVersion
from registry.signals import adapter_version_promoted, adapter_version_status_changed

logger = logging.getLogger(__name__)


def tenant_group(tenant_id: int) -> str:
    return f"tenant-{tenant_id}"


def _push_status(version: AdapterVersion) -> None:
    adapter = version.adapter
    message = {
        "type": "adapter.status",
        "adapter": adapter.name,
        "version": version.number,
        "status": version.status,
        "message": version.failure_message,
    }
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(tenant_group(adapter.tenant_id), message)
    except Exception:  # a push is best effort: the API and the database stay the source of truth
        logger.exception("could not push %s to %s", message, tenant_group(adapter.tenant_id))


def _status_changed(version: AdapterVersion) -> None:
    _push_status(version)
    adapter_version_status_changed.send(sender=AdapterVersion, version=version)


def status_changed_on_commit(version: AdapterVersion) -> None:
    transaction.on_commit(lambda: _status_changed(version), robust=True)


def promoted_on_commit(*, adapter: Adapter, version: AdapterVersion, previous: AdapterVersion | None) -> None:
    transaction.on_commit(
        lambda: adapter_version_promoted.send(
            sender=Adapter, adapter=adapter, version=version, previous_version=previous
        ),
        robust=True,
    )
