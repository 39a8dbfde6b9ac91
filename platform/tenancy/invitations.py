"""Membership by invitation: an admin invites an e-mail address; whoever holds the link (sent to that address)
accepts it, into the account they are logged in with or a new one. No lookup of anyone's account happens on the
inviting side, so nothing about users outside the tenant shows there."""

import hashlib
import secrets
from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.mail import send_mail
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from tenancy.audit import Actor, audit_record
from tenancy.authority import require_owner_rule, require_role
from tenancy.models import Invitation, Membership, Tenant

User = get_user_model()
Role = Membership.Role
NOT_VALID = "This invitation link is not valid, was already used, or has expired."


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def invitation_link(token: str) -> str:
    return settings.QUILT_PUBLIC_URL.rstrip("/") + reverse("api-invitation", kwargs={"token": token})


def invitation_page_link(token: str) -> str:
    """The console's page for the same token, where a person accepts in the browser."""
    return settings.QUILT_PUBLIC_URL.rstrip("/") + reverse("console:invitation", kwargs={"token": token})


def _send(*, invitation: Invitation, token: str) -> None:
    send_mail(
        subject=f"You're invited to {invitation.tenant.name} on Quilt",
        message=(
            f"You are invited to join {invitation.tenant.name} on Quilt as {invitation.role}.\n\n"
            f"Accept here: {invitation_page_link(token)}\n\n(From a program: POST to {invitation_link(token)})\n\n"
            f"The link works once and expires on {invitation.expires_at:%Y-%m-%d %H:%M} UTC."
        ),
        from_email=None,
        recipient_list=[invitation.email],
    )


def invitation_create(*, actor: Actor, tenant: Tenant, email: str, role: str) -> tuple[Invitation, str]:
    """Returns the invitation and its link (shown to the admin; e-mailed to the address once committed)."""
    require_role(actor=actor, tenant=tenant, minimum=Role.ADMIN, doing="invite members")
    require_owner_rule(actor=actor, tenant=tenant, roles=(role,))
    if role not in Role.values:
        raise ValidationError(f"Unknown role {role!r}.")
    token = secrets.token_urlsafe(32)
    with transaction.atomic():
        invitation = Invitation(
            tenant=tenant, email=email.strip(), role=role, token_hash=_hash(token), invited_by=actor.user,
            expires_at=timezone.now() + timedelta(seconds=settings.QUILT_INVITATION_TTL_SECONDS),
        )  # fmt: skip
        invitation.full_clean()
        invitation.save()
        audit_record(
            actor=actor, action="member.invite", target=invitation, tenant=tenant,
            after={"email": invitation.email, "role": role},
        )  # fmt: skip
        link = invitation_link(token)
        transaction.on_commit(lambda: _send(invitation=invitation, token=token))
    return invitation, link


def invitation_pending(*, token: str) -> Invitation:
    invitation = Invitation.objects.select_related("tenant").filter(token_hash=_hash(token)).first()
    usable = invitation is not None and invitation.accepted_at is None and invitation.revoked_at is None
    if not usable or invitation.expires_at <= timezone.now() or not invitation.tenant.is_active:
        raise ValidationError(NOT_VALID, code="invalid_invitation")
    return invitation


def _new_user(*, email: str, username: str, password: str):
    if not username or not password:
        raise ValidationError("Log in first, or choose a username and a password for a new account.")
    if User.objects.filter(username__iexact=username).exists():
        raise ValidationError("Choose another username.", code="conflict")
    user = User(username=username, email=email)
    validate_password(password, user)
    user.set_password(password)
    user.full_clean()
    user.save()
    return user


def invitation_accept(*, token: str, user=None, username: str = "", password: str = "") -> Membership:
    """Accepts into `user` (logged in) or into a new account (username, password) with the invited address."""
    with transaction.atomic():
        invitation = invitation_pending(token=token)
        invitation = Invitation.objects.select_for_update().select_related("tenant").get(pk=invitation.pk)
        if invitation.accepted_at is not None:
            raise ValidationError(NOT_VALID, code="invalid_invitation")
        if user is None:
            user = _new_user(email=invitation.email, username=username, password=password)
        membership, created = Membership.objects.get_or_create(
            tenant=invitation.tenant, user=user, defaults={"role": invitation.role}
        )
        invitation.accepted_at, invitation.accepted_by = timezone.now(), user
        invitation.save(update_fields=["accepted_at", "accepted_by"])
        if created:
            audit_record(
                actor=Actor(user=user), action="member.add", target=membership, tenant=invitation.tenant,
                after={"user": user.get_username(), "role": membership.role, "invitation": invitation.pk},
            )  # fmt: skip
    return membership


def invitation_revoke(*, actor: Actor, invitation: Invitation) -> Invitation:
    require_role(actor=actor, tenant=invitation.tenant, minimum=Role.ADMIN, doing="revoke invitations")
    with transaction.atomic():
        invitation = Invitation.objects.select_for_update().get(pk=invitation.pk)
        if invitation.accepted_at is not None or invitation.revoked_at is not None:
            raise ValidationError("This invitation is no longer pending.", code="conflict")
        invitation.revoked_at = timezone.now()
        invitation.save(update_fields=["revoked_at"])
        audit_record(
            actor=actor, action="member.invite_revoke", target=invitation, tenant=invitation.tenant,
            before={"email": invitation.email, "role": invitation.role},
        )  # fmt: skip
    return invitation
