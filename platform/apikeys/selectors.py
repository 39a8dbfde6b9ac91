"""Authenticating a presented key: lookup by public prefix, constant-time hash compare. No cache here: the
gateway keeps the one cache of verified callers (gateway.caller), which credential changes clear at once."""

from django.conf import settings
from django.core.cache import cache
from django.db.models import QuerySet
from django.utils import timezone

from apikeys.models import ApiKey
from tenancy.models import Tenant


class KeyRefused(Exception):
    """The key can't be used; `reason` says why in words a client can act on."""

    def __init__(self, reason: str, code: str = "invalid_api_key"):
        super().__init__(reason)
        self.reason = reason
        self.code = code


def _key_by_prefix(prefix: str) -> ApiKey | None:
    return ApiKey.objects.select_related("tenant", "tenant__plan", "created_by").filter(prefix=prefix).first()


def api_key_authenticate(*, presented: str) -> ApiKey:
    prefix, dot, _ = presented.partition(".")
    if not dot or not prefix or "\x00" in presented or len(presented) > 200:
        raise KeyRefused("Incorrect API key provided.")
    key = _key_by_prefix(prefix)
    if key is None or not key.is_valid(presented):
        raise KeyRefused("Incorrect API key provided.")
    if key.revoked:
        raise KeyRefused("This API key has been revoked.")
    if key.expiry_date is not None and key.expiry_date <= timezone.now():
        raise KeyRefused("This API key has expired.")
    if key.tenant.status != Tenant.Status.ACTIVE:
        raise KeyRefused(f"The tenant {key.tenant.slug} is {key.tenant.status}.", code="tenant_suspended")
    _touch_last_used(key)
    return key


def _touch_last_used(key: ApiKey) -> None:
    # One write per key per interval, not one per request.
    if cache.add(f"apikey-last-used:{key.pk}", 1, timeout=settings.QUILT_KEY_LAST_USED_INTERVAL_SECONDS):
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=timezone.now())


def api_keys_of(*, tenant: Tenant) -> QuerySet[ApiKey]:
    return ApiKey.objects.filter(tenant=tenant).select_related("created_by").order_by("-created", "-id")
