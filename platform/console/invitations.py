"""Invitation emails: a new member invited by email sets their own password through a one-time link."""

from django.conf import settings
from django.contrib.auth.tokens import default_token_generator
from django.core.mail import send_mail
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils.encoding import force_bytes
from django.utils.http import urlsafe_base64_encode

from tenancy.models import Tenant


def invitation_link(*, request, user) -> str:
    path = reverse(
        "console:password-set",
        kwargs={"uidb64": urlsafe_base64_encode(force_bytes(user.pk)), "token": default_token_generator.make_token(user)},
    )
    return request.build_absolute_uri(path)


# Backends that never reach an inbox (development, the demo, tests): the console shows the link instead.
UNDELIVERED_BACKENDS = {
    "django.core.mail.backends.console.EmailBackend", "django.core.mail.backends.locmem.EmailBackend",
    "django.core.mail.backends.filebased.EmailBackend", "django.core.mail.backends.dummy.EmailBackend",
}  # fmt: skip


def emails_reach_inboxes() -> bool:
    return settings.EMAIL_BACKEND not in UNDELIVERED_BACKENDS


def invitation_send(*, request, user, tenant: Tenant) -> str:
    """Sends the invitation; returns its link (the console shows it where no email is really delivered)."""
    context = {"user": user, "tenant": tenant, "inviter": request.user, "link": invitation_link(request=request, user=user)}
    send_mail(
        subject=f"You're invited to {tenant.name} on Quilt",
        message=render_to_string("console/email/invitation.txt", context),
        from_email=None,
        recipient_list=[user.email],
    )
    return context["link"]
