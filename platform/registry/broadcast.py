"""On-commit side effects of registry changes: the tenant's Channels group and the registry signals.

With a shared channel layer (Redis) a push from any process reaches every browser. The embedded default has
only an in-process layer, so a process that is not the web server (the Celery worker) also relays the message
over HTTP to the web server (QUILT_LIVE_RELAY_URL, set by `manage.py demo`), which pushes it to its sockets.
"""

import hmac
import logging

import httpx
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import transaction
from django.utils.crypto import salted_hmac

from registry.models import Adapter, AdapterVersion
from registry.signals import adapter_version_promoted, adapter_version_status_changed

logger = logging.getLogger(__name__)


def tenant_group(tenant_id: int) -> str:
    return f"tenant-{tenant_id}"


RELAY_GROUP_PREFIX = "tenant-"
RELAY_TIMEOUT_SECONDS = 2.0


def relay_token() -> str:
    """What the relay endpoint expects in its Authorization header; derived from SECRET_KEY, never stored."""
    return salted_hmac("quilt.live-relay", "relay").hexdigest()


def relay_token_valid(presented: str) -> bool:
    return hmac.compare_digest(presented.encode(), relay_token().encode())


def _relay(group: str, message: dict) -> None:
    url = getattr(settings, "QUILT_LIVE_RELAY_URL", "")
    if not url:
        return
    try:
        httpx.post(url, json={"group": group, "message": message}, timeout=RELAY_TIMEOUT_SECONDS,
                   headers={"Authorization": f"Bearer {relay_token()}"})  # fmt: skip
    except httpx.HTTPError as error:  # best effort, as the push itself: the page catches up when it loads
        logger.warning("could not relay %s to %s: %s", message.get("type"), url, error)


def push(group: str, message: dict) -> None:
    """Sends a message to a Channels group: through the channel layer, and through the relay where one is set."""
    layer = get_channel_layer()
    if layer is not None:
        try:
            async_to_sync(layer.group_send)(group, message)
        except Exception:  # a push is best effort: the API and the database stay the source of truth
            logger.exception("could not push %s to %s", message.get("type"), group)
    _relay(group, message)


def _push_status(version: AdapterVersion) -> None:
    adapter = version.adapter
    message = {
        "type": "adapter.status",
        "adapter": adapter.name,
        "version": version.number,
        "status": version.status,
        "message": version.failure_message,
    }
    push(tenant_group(adapter.tenant_id), message)


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
