"""Reads over tenants and memberships."""

from django.db.models import QuerySet
from django.utils import timezone

from tenancy.models import AuditLog, Invitation, Membership, Tenant


def tenants_for_user(*, user) -> QuerySet[Tenant]:
    if user.is_staff:
        return Tenant.objects.select_related("plan").all()
    return Tenant.objects.select_related("plan").filter(memberships__user=user)


def membership_for(*, user, tenant: Tenant) -> Membership | None:
    return Membership.objects.filter(user=user, tenant=tenant).first()


def members_of(*, tenant: Tenant) -> QuerySet[Membership]:
    return Membership.objects.select_related("user").filter(tenant=tenant).order_by("user__username")


def audit_log_list(*, tenant: Tenant | None = None, action: str = "", actor: str = "") -> QuerySet[AuditLog]:
    rows = AuditLog.objects.select_related("actor_user", "actor_key", "tenant")
    if tenant is not None:
        rows = rows.filter(tenant=tenant)
    if action:
        rows = rows.filter(action__startswith=action)
    if actor:
        rows = rows.filter(actor_user__username=actor)
    return rows


def invitations_of(*, tenant: Tenant) -> QuerySet[Invitation]:
    return Invitation.objects.filter(tenant=tenant).order_by("-created_at", "-id")



def invitations_pending_of(*, tenant: Tenant) -> QuerySet[Invitation]:
    """Not accepted, not revoked, not expired: the links that still work."""
    return invitations_of(tenant=tenant).select_related("invited_by").filter(
        accepted_at__isnull=True, revoked_at__isnull=True, expires_at__gt=timezone.now()
    )
