"""A tenant's settings page: the webhook URL (private targets refused), the webhook secret shown once."""

import re

import pytest
from django.urls import reverse

from tenancy.models import AuditLog, Tenant

pytestmark = pytest.mark.django_db


def settings_url(tenant, name="settings") -> str:
    return reverse(f"console:{name}", kwargs={"slug": tenant.slug})


def test_an_admin_saves_a_public_webhook_url_and_private_ones_are_refused(tenant, member_of, settings):
    settings.QUILT_WEBHOOK_ALLOWED_NETWORKS = []  # the test settings let a local receiver through
    client, _ = member_of(tenant, "admin")
    saved = client.post(settings_url(tenant), {"billing_email": "ap@acme.test", "webhook_url": "https://hooks.acme.test/in"},
                        follow=True)  # fmt: skip
    assert b"Settings saved." in saved.content
    tenant.refresh_from_db()
    assert (tenant.billing_email, tenant.webhook_url) == ("ap@acme.test", "https://hooks.acme.test/in")
    for inside in ["http://localhost:9000/hook", "http://metadata.internal/latest"]:
        refused = client.post(settings_url(tenant), {"billing_email": "", "webhook_url": inside})
        assert refused.status_code == 400
        assert b"Webhooks may only go to public addresses" in refused.content, inside
    assert Tenant.objects.get(pk=tenant.pk).webhook_url == "https://hooks.acme.test/in"


WEBHOOK_URLS = [
    ("https://93.184.216.34/hook", False), ("http://127.0.0.1:9000/hook", False), ("http://[::1]/hook", False),
    ("http://10.0.0.7/hook", False), ("http://localhost/hook", False), ("https://Hooks.example.com/q", False),
    ("https://hooks.example.com:8443/q?a=1", True),
]  # fmt: skip


@pytest.mark.parametrize(("url", "taken"), WEBHOOK_URLS)
def test_the_console_and_the_api_take_the_same_webhook_urls_with_developments_loopback_allowed(
    tenant, member_of, settings, url, taken
):
    """Loopback is let through at delivery in development; a URL is a host name all the same, in both."""
    settings.QUILT_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.1/32", "::1/128"]
    client, _ = member_of(tenant, "admin")
    console = client.post(settings_url(tenant), {"billing_email": "", "webhook_url": url})
    assert console.status_code == (302 if taken else 400), url
    assert (Tenant.objects.get(pk=tenant.pk).webhook_url == url) is taken
    Tenant.objects.filter(pk=tenant.pk).update(webhook_url="")
    api = client.patch("/api/v1/tenant", {"webhook_url": url}, content_type="application/json")
    assert api.status_code == (200 if taken else 400), api.content
    assert (Tenant.objects.get(pk=tenant.pk).webhook_url == url) is taken
    if not taken:  # one rule, one message
        message = api.json()["error"]["message"].removeprefix("webhook_url: ")
        assert message.encode() in console.content.replace(b"&#x27;", b"'"), (message, url)


def test_the_webhook_secret_is_shown_once_and_rotates(tenant, member_of):
    client, _ = member_of(tenant, "admin")
    assert b"Set a secret" in client.get(settings_url(tenant)).content
    first = client.post(settings_url(tenant, "webhook-secret"), follow=True)
    secret = re.search(rb'data-testid="webhook-secret">([^<]+)</code>', first.content).group(1).decode()
    tenant.refresh_from_db()
    assert tenant.webhook_secret == secret and len(secret) >= 32
    again = client.get(settings_url(tenant)).content
    assert secret.encode() not in again and b"Rotate secret" in again
    client.post(settings_url(tenant, "webhook-secret"))
    tenant.refresh_from_db()
    assert tenant.webhook_secret != secret
    rows = AuditLog.objects.filter(action="tenant.webhook_secret", tenant=tenant)
    assert rows.count() == 2 and all(secret not in str(row.after) for row in rows)


def test_developers_can_not_open_the_settings(tenant, member_of):
    client, _ = member_of(tenant, "developer")
    assert client.get(settings_url(tenant)).status_code == 403
    assert client.post(settings_url(tenant, "webhook-secret")).status_code == 403
    tenant.refresh_from_db()
    assert tenant.webhook_secret == ""
