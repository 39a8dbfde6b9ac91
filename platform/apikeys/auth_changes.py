"""Telling every gateway process that credentials changed, so their caches drop what they hold at once.

Any committed write to a key, a tenant, a plan or a membership (through a service, the Django admin or a shell) publishes one
message on a Redis channel (the gateway announces its models and prices on it too: gateway.receivers); each gateway
process listens on it in a daemon thread and clears its verified-caller cache. The cache's lifetime
(QUILT_KEY_CACHE_SECONDS: 30 s with Redis, 1 s without) remains the bound when Redis is not configured or the message
is lost. Receivers are used on purpose: they catch every write path, the admin's included.
"""

import logging
import threading
import time
from collections.abc import Callable

import redis
from django.conf import settings
from django.db import transaction
from django.db.models.signals import post_delete, post_save

log = logging.getLogger(__name__)


def channel() -> str:
    return f"{settings.QUILT_REDIS_KEY_PREFIX}:auth-changed"


def _publish() -> None:
    try:
        redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2).publish(channel(), b"1")
    except redis.RedisError as error:
        log.warning("could not announce a credential change (caches expire within %s s): %s",
                    settings.QUILT_KEY_CACHE_SECONDS, error)  # fmt: skip


def auth_changed(**_) -> None:
    """Announces, once the surrounding transaction commits, that keys, tenants or plans changed."""
    if settings.REDIS_URL:
        transaction.on_commit(_publish)


def connect_receivers() -> None:
    from apikeys.models import ApiKey
    from tenancy.models import Membership, Plan, Tenant

    for model in (ApiKey, Tenant, Plan, Membership):  # a member's role caps their keys
        post_save.connect(auth_changed, sender=model, dispatch_uid=f"auth-changed-save-{model.__name__}")
        post_delete.connect(auth_changed, sender=model, dispatch_uid=f"auth-changed-delete-{model.__name__}")


def listen(on_change: Callable[[], None]) -> threading.Thread | None:
    """Calls `on_change` for every announced change (and whenever the subscription starts over, since changes may
    have been missed meanwhile). Returns the daemon thread, or None without Redis."""
    if not settings.REDIS_URL:
        return None
    url, name = settings.REDIS_URL, channel()

    def run() -> None:
        while True:
            try:
                pubsub = redis.Redis.from_url(url, health_check_interval=5, socket_keepalive=True).pubsub()
                pubsub.subscribe(name)
                for _message in pubsub.listen():  # the subscribe confirmation too
                    on_change()
            except redis.RedisError as error:
                log.warning("credential-change listener lost Redis (%s); retrying", error)
            on_change()
            time.sleep(0.5)

    thread = threading.Thread(target=run, name="quilt-auth-changes", daemon=True)
    thread.start()
    return thread
