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
    saved = client.post(settings_url(tenant), {"billing_email": "ap@acme.test", "webhook_url": "https://93.184.216.34/hook"},
                        follow=True)  # fmt: skip
    assert b"Settings saved." in saved.content
    tenant.refresh_from_db()
    assert (tenant.billing_email, tenant.webhook_url) == ("ap@acme.test", "https://93.184.216.34/hook")
    for inside in ["http://127.0.0.1:9000/hook", "http://10.0.0.7/hook", "http://169.254.169.254/latest"]:
        refused = client.post(settings_url(tenant), {"billing_email": "", "webhook_url": inside})
        assert refused.status_code == 400
        assert b"Webhooks may only go to public addresses" in refused.content, inside
    assert Tenant.objects.get(pk=tenant.pk).webhook_url == "https://93.184.216.34/hook"


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
