"""Every mutating endpoint writes exactly one audit row in its own transaction; a failing action writes none."""

import pytest
from rest_framework.test import APIClient

from tenancy.models import AuditLog
from tests.platform.factories import MembershipFactory, UserFactory, make_key

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client():
    client = APIClient()
    client.force_login(UserFactory(is_staff=True), backend="django.contrib.auth.backends.ModelBackend")
    return client


def _one_row(client, method, url, body, action, **extra):
    before = AuditLog.objects.count()
    response = getattr(client, method)(url, body, format="json", **extra)
    assert response.status_code < 300, response.content
    rows = list(AuditLog.objects.order_by("-id")[: AuditLog.objects.count() - before])
    assert len(rows) == 1, [row.action for row in rows]
    assert rows[0].action == action
    return response, rows[0]


def test_each_mutation_writes_one_row(tenant_a, member_client, staff_client):
    owner, owner_membership = member_client(tenant_a, "owner")
    _, row = _one_row(owner, "post", "/api/v1/members", {"email": "new@x.test", "role": "viewer"}, "member.invite")
    assert row.actor_user == owner_membership.user and row.tenant == tenant_a and row.ip_address == "127.0.0.1"
    member_id = MembershipFactory(tenant=tenant_a, role="viewer").pk
    _one_row(owner, "patch", f"/api/v1/members/{member_id}", {"role": "developer"}, "member.change_role")
    _one_row(owner, "delete", f"/api/v1/members/{member_id}", None, "member.remove")
    response, row = _one_row(owner, "post", "/api/v1/keys", {"name": "k", "scopes": ["inference"]}, "api_key.create")
    prefix = response.json()["id"]
    assert response.json()["key"] not in str(row.after)
    response, _ = _one_row(owner, "post", f"/api/v1/keys/{prefix}/rotate", {"grace_seconds": 5}, "api_key.rotate")
    _one_row(owner, "post", f"/api/v1/keys/{response.json()['id']}/revoke", None, "api_key.revoke")
    _one_row(staff_client, "post", "/api/v1/tenants", {"slug": "t2", "name": "T2", "plan": "starter"}, "tenant.create")
    _, row = _one_row(staff_client, "patch", "/api/v1/tenants/t2", {"status": "suspended"}, "tenant.suspend")
    assert row.before["status"] == "active" and row.after["status"] == "suspended"
    _one_row(staff_client, "patch", "/api/v1/tenants/t2", {"status": "active"}, "tenant.reactivate")
    _one_row(staff_client, "post", "/api/v1/plans", {"slug": "p2", "name": "P2"}, "plan.create")
    _one_row(staff_client, "patch", "/api/v1/plans/p2", {"tokens_per_minute": 5}, "plan.update")


def test_a_key_actor_is_recorded(tenant_a):
    key, plaintext = make_key(tenant_a)
    client = APIClient(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    _, row = _one_row(client, "post", "/api/v1/keys", {"name": "child", "scopes": ["inference"]}, "api_key.create")
    assert row.actor_key == key and row.actor_user is None


def test_failing_actions_write_nothing(tenant_a, member_client, staff_client):
    owner, membership = member_client(tenant_a, "owner")
    MembershipFactory(tenant=tenant_a, role="viewer")
    before = AuditLog.objects.count()
    failures = [
        (owner, "post", "/api/v1/members", {"email": "not-an-address", "role": "viewer"}),
        (owner, "post", "/api/v1/members", {"username": "nobody-such", "role": "viewer"}),
        (owner, "delete", f"/api/v1/members/{membership.pk}", None),
        (owner, "post", "/api/v1/keys", {"name": "", "scopes": ["inference"]}),
        (owner, "post", "/api/v1/keys/nope/revoke", None),
        (staff_client, "post", "/api/v1/tenants", {"slug": "tenant-a", "name": "dup", "plan": "starter"}),
        (staff_client, "post", "/api/v1/tenants", {"slug": "x", "name": "x", "plan": "no-such-plan"}),
        (staff_client, "patch", "/api/v1/plans/starter", {"requests_per_minute": -1}),
    ]
    for client, method, url, body in failures:
        response = getattr(client, method)(url, body, format="json")
        assert 400 <= response.status_code < 500, (url, response.content)
        assert "error" in response.json()
    assert AuditLog.objects.count() == before
