"""The management API does what it says: a field the caller may not change is refused (never a 200 that changed
nothing), a suspended or closed tenant is read-only except for billing, and a CSV download's errors are JSON with
the right status."""

import pytest

from apikeys.models import ApiKey
from tenancy.models import Tenant

pytestmark = pytest.mark.django_db


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/json"), response.content[:200]
    return response.json()["error"]


@pytest.mark.parametrize("body", [{"name": "Renamed"}, {"plan": "enterprise"}, {"status": "closed"},
                                  {"billing_email": "ok@example.com", "slug": "taken-over"}],
                         ids=["name", "plan", "status", "with-an-allowed-one"])  # fmt: skip
def test_a_tenant_admin_patching_staffs_fields_gets_403_and_nothing_changes(tenant_a, key_client, body):
    client = key_client(tenant_a)[0]
    before = Tenant.objects.get(pk=tenant_a.pk)
    error = _error(client.patch("/api/v1/tenant", body, format="json"), 403)
    assert error["code"] == "staff_only" and list(body)[-1] in error["message"]
    after = Tenant.objects.get(pk=tenant_a.pk)
    assert (after.name, after.plan_id, after.status, after.slug, after.billing_email) == \
        (before.name, before.plan_id, before.status, before.slug, before.billing_email)


def test_an_unknown_tenant_field_is_400_naming_it(tenant_a, key_client):
    error = _error(key_client(tenant_a)[0].patch("/api/v1/tenant", {"colour": "blue"}, format="json"), 400)
    assert "colour: Unknown field" in error["message"]


def test_the_fields_a_tenant_admin_may_change_still_change(tenant_a, key_client):
    response = key_client(tenant_a)[0].patch("/api/v1/tenant", {"billing_email": "pay@example.com"}, format="json")
    assert response.status_code == 200 and response.json()["billing_email"] == "pay@example.com"


@pytest.mark.parametrize("status", [Tenant.Status.SUSPENDED, Tenant.Status.CLOSED])
def test_a_suspended_or_closed_tenant_is_read_only_except_billing(tenant_a, member_client, status):
    client, membership = member_client(tenant_a, role="owner")
    Tenant.objects.filter(pk=tenant_a.pk).update(status=status)
    assert client.get("/api/v1/keys").status_code == 200
    assert client.get("/api/v1/tenant").status_code == 200
    assert client.get("/api/v1/invoices").status_code == 200
    refusals = [
        client.post("/api/v1/keys", {"name": "new", "scopes": ["inference"]}, format="json"),
        client.post("/api/v1/members", {"email": "x@example.com", "role": "viewer"}, format="json"),
        client.patch("/api/v1/tenant", {"webhook_url": "https://hooks.example.com/q"}, format="json"),
        client.post("/api/v1/tenant/webhook-secret", {}, format="json"),
    ]
    for response in refusals:
        error = _error(response, 403)
        assert error["code"] == "tenant_suspended" and "read-only" in error["message"]
    assert not ApiKey.objects.filter(tenant=tenant_a, name="new").exists()
    billing = client.patch("/api/v1/tenant", {"billing_email": "pay@example.com"}, format="json")
    assert billing.status_code == 200 and billing.json()["billing_email"] == "pay@example.com"
    # the console alike: its forms are refused, its billing settings are not
    page = client.post(f"/t/{tenant_a.slug}/keys/", {"name": "console-key", "scopes": ["inference"]})
    assert page.status_code == 403
    assert not ApiKey.objects.filter(tenant=tenant_a, name="console-key").exists()
    assert client.get(f"/t/{tenant_a.slug}/keys/").status_code == 200
    settings = client.post(f"/t/{tenant_a.slug}/settings/", {"billing_email": "console@example.com", "webhook_url": ""})
    assert settings.status_code in (200, 302)
    assert Tenant.objects.get(pk=tenant_a.pk).billing_email == "console@example.com"


@pytest.mark.parametrize("path", [
    "/api/v1/usage.csv?start=2026-13-45",
    "/api/v1/usage?format=csv&start=abc",
    "/api/v1/usage.csv?since=2026-10-01",
], ids=["bad-day", "format-param", "unknown-parameter"])  # fmt: skip
def test_csv_errors_are_json_with_a_400(tenant_a, key_client, path):
    error = _error(key_client(tenant_a)[0].get(path), 400)
    assert error["type"] == "invalid_request_error" and error["message"]


def test_a_reversed_csv_range_is_json_with_a_422(tenant_a, key_client):
    error = _error(key_client(tenant_a)[0].get("/api/v1/usage.csv?start=2026-10-02&end=2026-10-01"), 422)
    assert error["code"] == "invalid_range" and error["message"]


def test_a_missing_invoice_csv_is_a_json_404(tenant_a, key_client, member_client):
    assert _error(key_client(tenant_a)[0].get("/api/v1/invoices/999999.csv"), 404)["code"] == "not_found"
    client = member_client(tenant_a, role="owner")[0]
    assert _error(client.get(f"/t/{tenant_a.slug}/billing/invoices/999999.csv"), 404)["code"] == "not_found"


def test_console_csv_errors_are_json(tenant_a, tenant_b, member_client):
    client = member_client(tenant_a, role="owner")[0]
    assert _error(client.get(f"/t/{tenant_a.slug}/usage.csv?since=yesterday"), 400)["code"] == "invalid_query"
    assert _error(client.get(f"/t/{tenant_b.slug}/usage.csv"), 404)["code"] == "not_found"  # not a member
    viewer = member_client(tenant_a, role="viewer")[0]
    assert _error(viewer.get(f"/t/{tenant_a.slug}/billing/invoices/1.csv"), 403)
    good = client.get(f"/t/{tenant_a.slug}/usage.csv")
    assert good.status_code == 200 and good["Content-Type"].startswith("text/csv")


@pytest.mark.parametrize("start", ["2026-1-5", "20261001", "abc", "2026-02-30", "２０２６-10-01"])
def test_usage_refuses_a_malformed_start_with_a_400_naming_it(tenant_a, key_client, start):
    error = _error(key_client(tenant_a)[0].get("/api/v1/usage", {"start": start}), 400)
    assert error["message"].startswith("start:")


def test_the_schema_documents_csv_downloads_errors_as_json(tenant_a, key_client):
    schema = key_client(tenant_a)[0].get("/api/schema/?format=json").json()
    for path in ("/api/v1/usage", "/api/v1/usage.csv", "/api/v1/invoices/{invoice_id}.csv"):
        responses = schema["paths"][path]["get"]["responses"]
        assert "text/csv" in responses["200"]["content"]
        assert all(list(body["content"]) == ["application/json"] for status, body in responses.items() if status >= "400")


def test_every_write_refuses_a_field_it_does_not_take(tenant_a, key_client, member_client):
    client = key_client(tenant_a)[0]
    keys_before = ApiKey.objects.count()
    error = _error(client.post("/api/v1/keys", {"name": "k", "scopes": ["inference"], "expires": "never"},
                               format="json"), 400)  # fmt: skip
    assert "expires: Unknown field" in error["message"]
    assert ApiKey.objects.count() == keys_before
    _, membership = member_client(tenant_a, role="viewer")
    error = _error(client.patch(f"/api/v1/members/{membership.pk}", {"role": "developer", "is_owner": True},
                                format="json"), 400)  # fmt: skip
    assert "is_owner: Unknown field" in error["message"]
    membership.refresh_from_db()
    assert membership.role == "viewer"
