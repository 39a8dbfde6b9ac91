"""Webhooks only to public addresses (at save and at delivery), lockout by username and address together, the
Django admin audited, tenants reading their own audit log, and the webhook secret set through the API."""

import hashlib
import hmac
import socket
from datetime import date
from decimal import Decimal

import pytest
from django.test import Client
from django.urls import reverse

from apikeys.models import ApiKey
from billing.alerts import budget_alerts_check
from billing.models import BudgetAlert
from metering.models import UsageMonth
from tenancy.models import AuditLog, Tenant
from tests.platform.factories import MembershipFactory, TenantFactory, UserFactory, make_key

pytestmark = pytest.mark.django_db
PRIVATE_TARGETS = [
    "http://127.0.0.1:8000/hook", "http://localhost/hook", "http://169.254.169.254/latest/meta-data/",
    "http://10.1.2.3/hook", "http://192.168.0.10/hook", "http://[::1]/hook", "http://[::ffff:127.0.0.1]/hook",
    "http://100.64.0.1/hook", "http://0.0.0.0/hook", "https://[fe80::1%25eth0]/hook", "file:///etc/passwd",
]  # fmt: skip


@pytest.fixture
def no_allowed_networks(settings):
    settings.QUILT_WEBHOOK_ALLOWED_NETWORKS = []


@pytest.mark.parametrize("url", PRIVATE_TARGETS)
def test_a_tenant_admin_can_not_point_webhooks_inside(url, tenant_a, member_client, no_allowed_networks):
    client, _ = member_client(tenant_a, "admin")
    response = client.patch("/api/v1/tenant", {"webhook_url": url}, format="json")
    assert response.status_code == 400, response.content
    tenant_a.refresh_from_db()
    assert tenant_a.webhook_url == ""


def test_staff_can_not_either(tenant_a, no_allowed_networks):
    staff = Client()
    staff.force_login(UserFactory(is_staff=True), backend="django.contrib.auth.backends.ModelBackend")
    response = staff.patch(
        "/api/v1/tenants/tenant-a", {"webhook_url": "http://127.0.0.1/x"}, content_type="application/json"
    )
    assert response.status_code == 400


def test_delivery_refuses_a_name_that_resolves_inside_after_it_was_saved(tenant_a, no_allowed_networks, monkeypatch):
    """The name was public when saved; at delivery it resolves to loopback (DNS rebinding): nothing is POSTed."""
    tenant_a.plan.monthly_token_budget = 10
    tenant_a.plan.save()
    Tenant.objects.filter(pk=tenant_a.pk).update(webhook_secret="s" * 32)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        Tenant.objects.filter(pk=tenant_a.pk).update(webhook_url=f"http://hooks.example.test:{port}/x")
        tenant_a.refresh_from_db()
        monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(socket.AF_INET, 1, 6, "", ("127.0.0.1", port))])
        UsageMonth.objects.create(
            tenant=tenant_a, month=date.today().replace(day=1), prompt_tokens=100, price=Decimal(0), cost=Decimal(0)
        )
        with pytest.raises(Exception, match="public addresses"):
            budget_alerts_check(tenant=tenant_a, month=date.today())
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody connected
    assert "public addresses" in BudgetAlert.objects.filter(tenant=tenant_a).first().webhook_error


def test_delivery_goes_to_the_address_that_was_checked_even_if_the_name_is_re_pointed(tenant_a, settings, monkeypatch):
    """DNS rebinding between the check and the connection: the first answer is allowed, every later one points
    elsewhere. The POST reaches the checked address, with the name in its Host header; the other one hears nothing."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    settings.QUILT_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.2/32"]  # stands in for a public address
    heard: list[tuple[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            heard.append((self.server.server_address[0], self.headers["Host"]))
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    checked = HTTPServer(("127.0.0.2", 0), Handler)
    port = checked.server_address[1]
    inside = HTTPServer(("127.0.0.3", port), Handler)  # the "internal" service the name is re-pointed to
    for server in (checked, inside):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    answers = iter(["127.0.0.2"])
    real_getaddrinfo = socket.getaddrinfo

    def rebinding(host, *args, **kwargs):
        if host != "hooks.example.test":
            return real_getaddrinfo(host, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers, "127.0.0.3"), port))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    tenant_a.plan.monthly_token_budget = 10
    tenant_a.plan.save()
    Tenant.objects.filter(pk=tenant_a.pk).update(webhook_url=f"http://hooks.example.test:{port}/x",
                                                 webhook_secret="s" * 32)  # fmt: skip
    tenant_a.refresh_from_db()
    UsageMonth.objects.create(  # 90%: one alert, one delivery
        tenant=tenant_a, month=date.today().replace(day=1), prompt_tokens=9, price=Decimal(0), cost=Decimal(0)
    )
    try:
        budget_alerts_check(tenant=tenant_a, month=date.today())
    finally:
        checked.shutdown()
        inside.shutdown()
    assert heard and all(item == ("127.0.0.2", f"hooks.example.test:{port}") for item in heard), heard
    assert BudgetAlert.objects.filter(tenant=tenant_a).exclude(webhook_sent_at=None).exists()


def test_five_failures_for_a_made_up_name_lock_no_real_user_out(settings):
    settings.AXES_ENABLED = True
    UserFactory(username="ops", is_staff=True)
    client = Client(REMOTE_ADDR="203.0.113.9")
    login = reverse("console:login")
    for _ in range(6):
        client.post(login, {"username": "no-such-user", "password": "guess"}, REMOTE_ADDR="203.0.113.9")
    response = client.post(login, {"username": "ops", "password": "pw-12345-secret"}, REMOTE_ADDR="203.0.113.9")
    assert response.status_code == 302
    # Failures for the real name lock that name from that address, and not from another.
    attacker = Client()
    for _ in range(6):
        attacker.post(login, {"username": "ops", "password": "guess"}, REMOTE_ADDR="198.51.100.7")
    locked = attacker.post(login, {"username": "ops", "password": "pw-12345-secret"}, REMOTE_ADDR="198.51.100.7")
    assert locked.status_code != 302
    elsewhere = Client().post(login, {"username": "ops", "password": "pw-12345-secret"}, REMOTE_ADDR="192.0.2.1")
    assert elsewhere.status_code == 302


def test_django_admin_changes_are_audited(tenant_a):
    staff = UserFactory(is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff, backend="django.contrib.auth.backends.ModelBackend")
    key, _ = make_key(tenant_a, scopes=["inference"])
    url = reverse("admin:apikeys_apikey_delete", args=[key.pk])
    assert client.post(url, {"post": "yes"}).status_code == 302
    assert not ApiKey.objects.filter(pk=key.pk).exists()
    row = AuditLog.objects.get(action="api_key.delete")
    assert row.actor_user == staff and row.tenant == tenant_a and row.target_type == "ApiKey"
    assert row.before["name"] == key.name and not any("hash" in field for field in row.before)
    keys = [make_key(tenant_a, scopes=["inference"])[0] for _ in range(2)]
    changelist = reverse("admin:apikeys_apikey_changelist")
    client.post(changelist, {"action": "delete_selected", "_selected_action": [k.pk for k in keys], "post": "yes"})
    assert AuditLog.objects.filter(action="api_key.delete").count() == 3


def _admin_form(client, url: str) -> dict:
    """What the admin's change form would post back unchanged (its fields and its inlines' management forms)."""
    page = client.get(url)
    data = {name: "" if value is None else value for name, value in page.context["adminform"].form.initial.items()}
    for inline in page.context["inline_admin_formsets"]:
        formset = inline.formset
        data |= {f"{formset.management_form.prefix}-{k}": v for k, v in formset.management_form.initial.items()}
        for index, form in enumerate(formset.forms):
            data |= {f"{formset.prefix}-{index}-{k}": "" if v is None else v for k, v in form.initial.items()}
            data[f"{formset.prefix}-{index}-id"] = form.instance.pk
            data[f"{formset.prefix}-{index}-{formset.fk.name}"] = formset.instance.pk
    return data


def test_a_change_at_the_admin_is_audited_as_the_api_audits_it(tenant_a):
    from tenancy.models import Membership, Plan

    staff = UserFactory(is_staff=True, is_superuser=True)
    admin_site = Client()
    admin_site.force_login(staff, backend="django.contrib.auth.backends.ModelBackend")
    plan = Plan.objects.create(slug="audited", name="Audited", requests_per_minute=10)
    api = Client()
    api.force_login(staff, backend="django.contrib.auth.backends.ModelBackend")
    assert api.patch(f"/api/v1/plans/{plan.slug}", {"requests_per_minute": 20},
                     content_type="application/json").status_code == 200  # fmt: skip

    url = reverse("admin:tenancy_plan_change", args=[plan.pk])
    assert admin_site.post(url, _admin_form(admin_site, url) | {"requests_per_minute": 99}).status_code == 302
    by_api, by_admin = AuditLog.objects.filter(action="plan.update", target_id=str(plan.pk)).order_by("id")
    assert (by_api.before["requests_per_minute"], by_api.after["requests_per_minute"]) == (10, 20)
    assert (by_admin.before["requests_per_minute"], by_admin.after["requests_per_minute"]) == (20, 99)
    assert by_admin.actor_user == staff and by_admin.target_type == by_api.target_type == "Plan"
    assert by_admin.before["price_input_per_mtok"] == by_api.before["price_input_per_mtok"]  # the same values

    member = MembershipFactory(tenant=tenant_a, role="viewer")
    url = reverse("admin:tenancy_tenant_change", args=[tenant_a.pk])
    form = _admin_form(admin_site, url)
    index = next(i for i in range(len(Membership.objects.filter(tenant=tenant_a))) if
                 form[f"memberships-{i}-id"] == member.pk)  # fmt: skip
    assert admin_site.post(url, form | {f"memberships-{index}-role": "admin"}).status_code == 302
    row = AuditLog.objects.get(action="membership.update")
    assert (row.before["role"], row.after["role"], row.tenant) == ("viewer", "admin", tenant_a)
    assert not AuditLog.objects.filter(action="tenant.update").exists()  # the tenant itself did not change


def test_tenants_read_their_own_audit_log_and_no_one_elses(tenant_a, tenant_b, member_client):
    client, admin = member_client(tenant_a, "admin")
    other_client, _ = member_client(tenant_b, "admin")
    client.post("/api/v1/keys", {"name": "a", "scopes": ["inference"]}, format="json")
    other_client.post("/api/v1/keys", {"name": "b", "scopes": ["inference"]}, format="json")
    page = client.get("/api/v1/tenant/audit?limit=1").json()
    assert page["count"] == 1 and page["results"][0]["tenant"] == "tenant-a"
    assert page["results"][0]["actor"] == admin.user.username
    viewer, _ = member_client(tenant_a, "viewer")
    assert viewer.get("/api/v1/tenant/audit").status_code == 403


def test_the_webhook_secret_is_set_and_rotated_through_the_api_and_signs_deliveries(tenant_a, member_client):
    client, _ = member_client(tenant_a, "admin")
    developer, _ = member_client(tenant_a, "developer")
    assert developer.post("/api/v1/tenant/webhook-secret", {}, format="json").status_code == 403
    first = client.post("/api/v1/tenant/webhook-secret", {}, format="json").json()["webhook_secret"]
    chosen = "c" * 40
    assert client.post("/api/v1/tenant/webhook-secret", {"secret": chosen}, format="json").status_code == 200
    assert client.post("/api/v1/tenant/webhook-secret", {"secret": "short"}, format="json").status_code == 400
    tenant_a.refresh_from_db()
    assert tenant_a.webhook_secret == chosen != first
    assert client.get("/api/v1/tenant").json()["webhook_secret_set"] is True
    rows = AuditLog.objects.filter(action="tenant.webhook_secret", tenant=tenant_a)
    assert rows.count() == 2 and chosen not in str(list(rows.values()))
    from billing.alerts import webhook_signature

    expected = "sha256=" + hmac.new(chosen.encode(), b"{}", hashlib.sha256).hexdigest()
    assert webhook_signature(secret=tenant_a.webhook_secret, body=b"{}") == expected


def test_an_admin_key_can_not_read_another_tenants_audit(tenant_a, tenant_b):
    MembershipFactory(tenant=tenant_b, role="owner")
    TenantFactory()
    _, plaintext = make_key(tenant_a, scopes=["admin"])
    from tests.platform.conftest import client_for_key

    assert client_for_key(plaintext).get("/api/v1/tenant/audit", HTTP_X_QUILT_TENANT="tenant-b").json()["count"] == 0
