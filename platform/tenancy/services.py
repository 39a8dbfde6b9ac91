"""Writes to plans, tenants and memberships. Each top-level action is atomic and audited once."""

import secrets
from decimal import Decimal

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import transaction
from django.forms.models import model_to_dict

from tenancy.audit import Actor, audit_record
from tenancy.authority import (
    BILLING_SETTINGS,
    has_full_authority,
    require_owner_rule,
    require_role,
    require_writable,
)
from tenancy.invitations import invitation_create
from tenancy.models import Membership, Plan, Tenant
from tenancy.signals import body_retention_changed

User = get_user_model()
INVITE_BY_EMAIL = "Members join by invitation: give the e-mail address to invite."

PLAN_FIELDS = [
    "slug", "name", "requests_per_minute", "tokens_per_minute", "max_concurrent_requests", "monthly_token_budget",
    "monthly_spend_limit", "max_adapters", "adapter_warm_tier", "max_warm_adapters", "max_adapter_bytes", "max_file_storage_bytes", "default_max_tokens", "scheduling_weight",
    "price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok",
    "max_concurrent_fine_tuning_jobs", "price_training_per_mtok",
]  # fmt: skip
TENANT_FIELDS = ["slug", "name", "status", "plan", "billing_email", "webhook_url"]


def _snapshot(instance, fields: list[str]) -> dict:
    data = model_to_dict(instance, fields=fields)
    return {key: str(value) if isinstance(value, Decimal) else value for key, value in data.items()}


def _apply(instance, fields: list[str], changes: dict) -> None:
    unknown = set(changes) - set(fields)
    if unknown:
        raise ValidationError(f"Unknown fields: {', '.join(sorted(unknown))}")
    for field, value in changes.items():
        setattr(instance, field, value)
    instance.full_clean()
    instance.save()


def _locked_change(instance, fields: list[str], changes: dict):
    """Locks the row, applies `changes` to it; (the locked instance, snapshot before, snapshot after) for the audit.
    Call inside transaction.atomic()."""
    locked = type(instance).objects.select_for_update().get(pk=instance.pk)
    before = _snapshot(locked, fields)
    _apply(locked, fields, changes)
    return locked, before, _snapshot(locked, fields)


def plan_create(*, actor: Actor, **fields) -> Plan:
    with transaction.atomic():
        plan = Plan(**{key: value for key, value in fields.items() if key in PLAN_FIELDS})
        plan.full_clean()
        plan.save()
        audit_record(actor=actor, action="plan.create", target=plan, tenant=None, after=_snapshot(plan, PLAN_FIELDS))
    return plan


def plan_update(*, actor: Actor, plan: Plan, changes: dict) -> Plan:
    with transaction.atomic():
        plan, before, after = _locked_change(plan, PLAN_FIELDS, changes)
        audit_record(actor=actor, action="plan.update", target=plan, tenant=None, before=before, after=after)
    return plan


def tenant_create(*, actor: Actor, slug: str, name: str, plan: Plan, billing_email: str = "") -> Tenant:
    with transaction.atomic():
        tenant = Tenant(slug=slug, name=name, plan=plan, billing_email=billing_email)
        tenant.full_clean()
        tenant.save()
        audit_record(
            actor=actor, action="tenant.create", target=tenant, tenant=tenant, after=_snapshot(tenant, TENANT_FIELDS)
        )
    return tenant


def tenant_update(*, actor: Actor, tenant: Tenant, changes: dict) -> Tenant:
    """Changes a tenant's name, plan or status. Suspending stops its keys at once (they check the status)."""
    with transaction.atomic():
        tenant, before, after = _locked_change(tenant, TENANT_FIELDS, changes)
        action = "tenant.update"
        if "status" in changes and before["status"] != tenant.status:
            action = {"suspended": "tenant.suspend", "active": "tenant.reactivate", "closed": "tenant.close"}[
                tenant.status
            ]
        audit_record(actor=actor, action=action, target=tenant, tenant=tenant, before=before, after=after)
    return tenant


def _user_for(*, username: str = "", email: str = "") -> "User":
    if username:
        user = User.objects.filter(username=username).first()
        if user is None and not email:
            raise ValidationError(f"No user named {username!r}. Give an email to invite a new user.")
    else:
        user = User.objects.filter(email__iexact=email).first() if email else None
    if user is None:
        if not email:
            raise ValidationError("Give a username or an email.")
        user = User(username=username or email, email=email)
        user.set_unusable_password()
        user.full_clean()
        user.save()
    return user


def member_add(*, actor: Actor, tenant: Tenant, role: str, username: str = "", email: str = "") -> Membership:
    """Platform staff and the system add an existing user (by username or email) or a new one by email (no
    password until they set one). A tenant's own admins add nobody's existing account: an address with no
    account gets a fresh one (its set-password link is the acceptance); any other address is sent an
    invitation to accept (tenancy.invitations), and this raises a ValidationError saying so."""
    require_owner_rule(actor=actor, tenant=tenant, roles=(role,))
    if not has_full_authority(actor):
        require_role(actor=actor, tenant=tenant, minimum=Membership.Role.ADMIN, doing="add members")
        if username or not email:
            raise ValidationError(INVITE_BY_EMAIL)
        if User.objects.filter(email__iexact=email).exists() or User.objects.filter(username__iexact=email).exists():
            invitation_create(actor=actor, tenant=tenant, email=email, role=role)
            raise ValidationError(f"An invitation to join {tenant.name} was sent to {email}.", code="invited")
    with transaction.atomic():
        user = _user_for(username=username, email=email)
        if Membership.objects.filter(tenant=tenant, user=user).exists():
            raise ValidationError(f"{user.get_username()} is already a member of {tenant.slug}.")
        membership = Membership(tenant=tenant, user=user, role=role)
        membership.full_clean()
        membership.save()
        audit_record(
            actor=actor, action="member.add", target=membership, tenant=tenant,
            after={"user": user.get_username(), "role": role},
        )  # fmt: skip
    return membership


def _ensure_an_owner_remains(*, tenant: Tenant, leaving: Membership) -> None:
    others = Membership.objects.filter(tenant=tenant, role=Membership.Role.OWNER).exclude(pk=leaving.pk)
    if leaving.role == Membership.Role.OWNER and not others.exists():
        raise ValidationError("A tenant must keep at least one owner.", code="conflict")


def member_change_role(*, actor: Actor, membership: Membership, role: str) -> Membership:
    with transaction.atomic():
        membership = Membership.objects.select_for_update().get(pk=membership.pk)
        require_role(actor=actor, tenant=membership.tenant, minimum=Membership.Role.ADMIN, doing="change roles")
        require_owner_rule(actor=actor, tenant=membership.tenant, roles=(membership.role, role))
        before = {"role": membership.role}
        if role != Membership.Role.OWNER:
            _ensure_an_owner_remains(tenant=membership.tenant, leaving=membership)
        membership.role = role
        membership.full_clean()
        membership.save()
        audit_record(
            actor=actor, action="member.change_role", target=membership, tenant=membership.tenant,
            before=before, after={"role": role},
        )  # fmt: skip
    return membership


def member_remove(*, actor: Actor, membership: Membership) -> None:
    with transaction.atomic():
        membership = Membership.objects.select_for_update().get(pk=membership.pk)
        require_role(actor=actor, tenant=membership.tenant, minimum=Membership.Role.ADMIN, doing="remove members")
        require_owner_rule(actor=actor, tenant=membership.tenant, roles=(membership.role,))
        _ensure_an_owner_remains(tenant=membership.tenant, leaving=membership)
        audit_record(
            actor=actor, action="member.remove", target=membership, tenant=membership.tenant,
            before={"user": membership.user.get_username(), "role": membership.role},
        )  # fmt: skip
        membership.delete()


TENANT_SETTINGS_FIELDS = ["billing_email", "webhook_url", "request_body_retention_days"]


def tenant_settings_update(*, actor: Actor, tenant: Tenant, changes: dict) -> Tenant:
    """A tenant's own admins change where its billing mail and webhooks go (name, plan and status are staff's)."""
    require_role(actor=actor, tenant=tenant, minimum=Membership.Role.ADMIN, doing="change the tenant's settings")
    changed = {name for name, value in changes.items() if getattr(tenant, name, None) != value}
    require_writable(tenant=tenant, billing=changed <= BILLING_SETTINGS)
    with transaction.atomic():
        tenant, before, after = _locked_change(tenant, TENANT_SETTINGS_FIELDS, changes)
        audit_record(actor=actor, action="tenant.settings", target=tenant, tenant=tenant, before=before, after=after)
        days = after["request_body_retention_days"]
        if days != before["request_body_retention_days"]:  # metering deletes or shortens what it kept, in this
            body_retention_changed.send(sender=Tenant, tenant_id=tenant.pk, days=days)  # same transaction
    return tenant


def tenant_webhook_secret_set(*, actor: Actor, tenant: Tenant, secret: str = "") -> str:
    """Sets the secret webhooks are signed with (a new random one when none is given) and returns it; the audit
    row records that it changed, never the secret."""
    require_role(actor=actor, tenant=tenant, minimum=Membership.Role.ADMIN, doing="set the webhook secret")
    secret = secret or secrets.token_urlsafe(32)
    if not 32 <= len(secret) <= 64 or not (secret.isascii() and secret.isprintable()):
        raise ValidationError("A webhook secret is 32 to 64 printable ASCII characters.")
    with transaction.atomic():
        tenant = Tenant.objects.select_for_update().get(pk=tenant.pk)
        had_one = bool(tenant.webhook_secret)
        tenant.webhook_secret = secret
        tenant.save(update_fields=["webhook_secret", "updated_at"])
        audit_record(
            actor=actor, action="tenant.webhook_secret", target=tenant, tenant=tenant,
            before={"webhook_secret_set": had_one}, after={"webhook_secret_set": True},
        )  # fmt: skip
    return secret
