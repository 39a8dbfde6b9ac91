"""Creating, revoking and rotating keys. The plaintext leaves these functions once and is never stored.

Nobody creates, rotates or revokes a key with scopes beyond their own role (tenancy.authority)."""

from datetime import datetime, timedelta
from decimal import Decimal

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from apikeys.models import ApiKey, Scope
from tenancy.audit import Actor, audit_record
from tenancy.authority import require_role, require_scopes_within_role
from tenancy.models import Membership, Tenant

MAX_ROTATION_GRACE = timedelta(days=30)


def _snapshot(key: ApiKey) -> dict:
    return {
        "name": key.name,
        "prefix": key.prefix,
        "scopes": key.scopes,
        "allowed_models": key.allowed_models,
        "expiry_date": key.expiry_date.isoformat() if key.expiry_date else None,
        "revoked": key.revoked,
        "monthly_spend_limit": str(key.monthly_spend_limit) if key.monthly_spend_limit is not None else None,
        "requests_per_minute": key.requests_per_minute,
        "tokens_per_minute": key.tokens_per_minute,
    }


def _validate_scopes(scopes: list[str]) -> list[str]:
    if not scopes:
        raise ValidationError("A key needs at least one scope.")
    unknown = sorted(set(scopes) - set(Scope.values))
    if unknown:
        raise ValidationError(f"Unknown scopes: {', '.join(unknown)}. Known: {', '.join(Scope.values)}.")
    return sorted(set(scopes))


def _new_key(
    *, tenant: Tenant, name: str, scopes: list[str], allowed_models: list[str], expiry_date, created_by, **limits
) -> tuple[ApiKey, str]:
    if expiry_date is not None and expiry_date <= timezone.now():
        raise ValidationError("The expiry must be in the future.", code="expiry_past")
    if not name or len(name) > 50:
        raise ValidationError("A key needs a name of 1 to 50 characters.")
    return ApiKey.objects.create_key(
        tenant=tenant,
        name=name,
        scopes=_validate_scopes(scopes),
        allowed_models=sorted(set(allowed_models)),
        expiry_date=expiry_date,
        created_by=created_by,
        **limits,
    )


def api_key_create(
    *,
    actor: Actor,
    tenant: Tenant,
    name: str,
    scopes: list[str],
    allowed_models: list[str] | None = None,
    expiry_date: datetime | None = None,
) -> tuple[ApiKey, str]:
    require_scopes_within_role(actor=actor, tenant=tenant, scopes=_validate_scopes(scopes))
    with transaction.atomic():
        key, plaintext = _new_key(
            tenant=tenant, name=name, scopes=scopes, allowed_models=allowed_models or [],
            expiry_date=expiry_date, created_by=actor.user,
        )  # fmt: skip
        audit_record(actor=actor, action="api_key.create", target=key, tenant=tenant, after=_snapshot(key))
    return key, plaintext


def api_key_revoke(*, actor: Actor, key: ApiKey) -> ApiKey:
    with transaction.atomic():
        key = ApiKey.objects.select_for_update().get(pk=key.pk)
        require_scopes_within_role(actor=actor, tenant=key.tenant, scopes=key.scopes)
        if key.revoked:
            raise ValidationError("This key is already revoked.", code="conflict")
        before = _snapshot(key)
        key.revoked = True
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked", "revoked_at"])
        audit_record(
            actor=actor, action="api_key.revoke", target=key, tenant=key.tenant, before=before, after=_snapshot(key)
        )
    return key


def api_key_rotate(*, actor: Actor, key: ApiKey, grace: timedelta) -> tuple[ApiKey, str]:
    """Issues a successor with the same settings and lineage (so the same month's spend against the same budget); the
    old key keeps working until now + grace, then stops."""
    if grace < timedelta(0) or grace > MAX_ROTATION_GRACE:
        raise ValidationError(f"The grace period must be between 0 seconds and {MAX_ROTATION_GRACE.days} days.")
    with transaction.atomic():
        old = ApiKey.objects.select_for_update().get(pk=key.pk)
        require_scopes_within_role(actor=actor, tenant=old.tenant, scopes=old.scopes)
        if not old.is_usable:
            raise ValidationError("Only a usable key can be rotated.", code="conflict")
        if old.replaced_by_id is not None:
            raise ValidationError("This key has already been rotated.", code="conflict")
        before = _snapshot(old)
        new, plaintext = _new_key(
            tenant=old.tenant, name=old.name, scopes=old.scopes, allowed_models=old.allowed_models,
            expiry_date=old.expiry_date, created_by=actor.user, monthly_spend_limit=old.monthly_spend_limit,
            requests_per_minute=old.requests_per_minute, tokens_per_minute=old.tokens_per_minute,
            lineage=old.lineage or old.prefix,  # the month's spend and the budget go on with the successor
        )  # fmt: skip
        deadline = timezone.now() + grace
        old.expiry_date = min(deadline, old.expiry_date) if old.expiry_date else deadline
        old.replaced_by = new
        old.save(update_fields=["expiry_date", "replaced_by"])
        after = _snapshot(old) | {"replaced_by": new.prefix}
        audit_record(actor=actor, action="api_key.rotate", target=old, tenant=old.tenant, before=before, after=after)
    return new, plaintext


def api_key_limits_set(
    *, actor: Actor, key: ApiKey, monthly_spend_limit: Decimal | None, requests_per_minute: int | None,
    tokens_per_minute: int | None,
) -> ApiKey:
    """Sets the key's own monthly budget and rate limits (None: none of its own; the tenant's still apply). Money,
    so it needs the admin role; the gateway applies it within a second (a key change clears its caches)."""
    if monthly_spend_limit is not None and monthly_spend_limit < 0:
        raise ValidationError("A monthly budget can't be negative.")
    for name, value in (("requests per minute", requests_per_minute), ("tokens per minute", tokens_per_minute)):
        if value is not None and value < 1:
            raise ValidationError(f"A limit of {name} must be at least 1 (leave it empty for none).")
    with transaction.atomic():
        key = ApiKey.objects.select_for_update().get(pk=key.pk)
        require_role(actor=actor, tenant=key.tenant, minimum=Membership.Role.ADMIN, doing="set a key's budget and limits")
        before = _snapshot(key)
        key.monthly_spend_limit = monthly_spend_limit
        key.requests_per_minute, key.tokens_per_minute = requests_per_minute, tokens_per_minute
        key.save(update_fields=["monthly_spend_limit", "requests_per_minute", "tokens_per_minute"])
        audit_record(
            actor=actor, action="api_key.limits", target=key, tenant=key.tenant, before=before, after=_snapshot(key)
        )
    return key
