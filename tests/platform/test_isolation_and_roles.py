"""A credential of tenant A never reaches tenant B's objects; roles and scopes gate what members and keys do."""

import pytest
from rest_framework.test import APIClient

from apikeys.models import ApiKey
from tenancy.models import AuditLog, Invitation, Membership
from tests.platform.factories import MembershipFactory, UserFactory, make_key

pytestmark = pytest.mark.django_db


@pytest.fixture
def b_objects(tenant_b):
    member = MembershipFactory(tenant=tenant_b, role="owner")
    key, _ = make_key(tenant_b, name="b-key")
    return {"member": member, "key": key}


def _b_object_requests(b_objects):
    member_id, key_prefix = b_objects["member"].pk, b_objects["key"].prefix
    return [
        ("get", f"/api/v1/members/{member_id}", None),
        ("patch", f"/api/v1/members/{member_id}", {"role": "viewer"}),
        ("delete", f"/api/v1/members/{member_id}", None),
        ("get", f"/api/v1/keys/{key_prefix}", None),
        ("post", f"/api/v1/keys/{key_prefix}/revoke", None),
        ("post", f"/api/v1/keys/{key_prefix}/rotate", {"grace_seconds": 60}),
    ]


@pytest.mark.parametrize("credential", ["member", "key"])
def test_every_object_of_another_tenant_is_404(credential, tenant_a, b_objects, member_client, key_client):
    client = member_client(tenant_a, "owner")[0] if credential == "member" else key_client(tenant_a)[0]
    for method, url, body in _b_object_requests(b_objects):
        response = getattr(client, method)(url, body, format="json")
        assert response.status_code == 404, (method, url, response.content)
        assert response.json()["error"]["type"] == "not_found_error"
    b_objects["key"].refresh_from_db()
    assert not b_objects["key"].revoked
    assert Membership.objects.get(pk=b_objects["member"].pk).role == "owner"
    assert not AuditLog.objects.filter(tenant=b_objects["member"].tenant).exclude(action="tenant.create").exists()


def test_lists_show_only_the_callers_tenant(tenant_a, b_objects, member_client, key_client):
    client, membership = member_client(tenant_a, "owner")
    members = client.get("/api/v1/members").json()["results"]
    assert [row["username"] for row in members] == [membership.user.username]
    key_client_a, key_a, _ = key_client(tenant_a)
    keys = key_client_a.get("/api/v1/keys").json()["results"]
    assert [row["id"] for row in keys] == [key_a.prefix]
    assert key_client_a.get("/api/v1/tenant").json()["slug"] == "tenant-a"


def test_a_member_of_a_can_not_pick_tenant_b_by_header(tenant_a, tenant_b, member_client):
    client, _ = member_client(tenant_a, "owner")
    response = client.get("/api/v1/members", HTTP_X_QUILT_TENANT="tenant-b")
    assert response.status_code == 404


def test_viewer_can_not_create_keys(tenant_a, member_client):
    client, _ = member_client(tenant_a, "viewer")
    assert client.get("/api/v1/keys").status_code == 200
    response = client.post("/api/v1/keys", {"name": "x", "scopes": ["inference"]}, format="json")
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "insufficient_role"
    assert not ApiKey.objects.exists()


def test_developer_can_create_keys_but_not_manage_members(tenant_a, member_client):
    client, _ = member_client(tenant_a, "developer")
    assert client.post("/api/v1/keys", {"name": "x", "scopes": ["inference"]}, format="json").status_code == 201
    response = client.post("/api/v1/members", {"email": "other@x.test", "role": "viewer"}, format="json")
    assert response.status_code == 403
    assert not Invitation.objects.exists()


def test_admin_manages_members_but_only_an_owner_makes_owners(tenant_a, member_client):
    admin_client, _ = member_client(tenant_a, "admin")
    owner_client, _ = member_client(tenant_a, "owner")
    assert admin_client.post("/api/v1/members", {"email": "a@x.test", "role": "owner"}, format="json").status_code == 403
    response = admin_client.post("/api/v1/members", {"email": "a@x.test", "role": "developer"}, format="json")
    assert response.status_code == 201
    member_id = MembershipFactory(tenant=tenant_a, role="developer").pk
    assert admin_client.patch(f"/api/v1/members/{member_id}", {"role": "owner"}, format="json").status_code == 403
    assert owner_client.patch(f"/api/v1/members/{member_id}", {"role": "owner"}, format="json").status_code == 200


def test_the_last_owner_can_not_leave(tenant_a, member_client):
    client, membership = member_client(tenant_a, "owner")
    response = client.delete(f"/api/v1/members/{membership.pk}")
    assert response.status_code == 409
    assert "at least one owner" in response.json()["error"]["message"]


def test_key_without_admin_scope_can_not_manage_keys(tenant_a, key_client):
    client, _, _ = key_client(tenant_a, scopes=("inference",))
    response = client.post("/api/v1/keys", {"name": "x", "scopes": ["inference"]}, format="json")
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "insufficient_scope"


def test_staff_can_do_everything(tenant_a, b_objects):
    staff = UserFactory(is_staff=True)
    client = APIClient()
    client.force_login(staff, backend="django.contrib.auth.backends.ModelBackend")
    response = client.post("/api/v1/tenants", {"slug": "newco", "name": "NewCo", "plan": "starter"}, format="json")
    assert response.status_code == 201
    assert client.patch("/api/v1/tenants/newco", {"status": "suspended"}, format="json").json()["status"] == "suspended"
    response = client.post("/api/v1/plans", {"slug": "gold", "name": "Gold", "price_output_per_mtok": "1.25"}, format="json")
    assert response.status_code == 201
    assert client.patch("/api/v1/plans/gold", {"requests_per_minute": 999}, format="json").status_code == 200
    tuned = client.patch("/api/v1/plans/gold", {"price_training_per_mtok": "4.5", "max_concurrent_fine_tuning_jobs": 3},
                         format="json").json()  # fmt: skip
    assert (tuned["price_training_per_mtok"], tuned["max_concurrent_fine_tuning_jobs"]) == ("4.500000", 3)
    assert client.get("/api/v1/plans/gold").json()["max_concurrent_fine_tuning_jobs"] == 3
    assert client.get("/api/v1/audit?action=tenant").json()["count"] >= 2
    member_id = b_objects["member"].pk
    assert client.get(f"/api/v1/members/{member_id}", HTTP_X_QUILT_TENANT="tenant-b").status_code == 200
    assert client.post("/api/v1/keys", {"name": "k", "scopes": ["inference"]}, format="json",
                       HTTP_X_QUILT_TENANT="tenant-a").status_code == 201  # fmt: skip


@pytest.mark.parametrize("credential", ["owner", "admin-key"])
def test_staff_endpoints_are_refused_to_tenants(credential, tenant_a, member_client, key_client):
    client = member_client(tenant_a, "owner")[0] if credential == "owner" else key_client(tenant_a)[0]
    for url in ("/api/v1/tenants", "/api/v1/plans", "/api/v1/audit"):
        assert client.get(url).status_code == 403
    assert client.post("/api/v1/tenants", {"slug": "x", "name": "x", "plan": "starter"}, format="json").status_code == 403


def test_anonymous_requests_get_an_openai_shaped_401():
    response = APIClient().get("/api/v1/tenant")
    assert response.status_code in (401, 403)
    body = APIClient(HTTP_AUTHORIZATION="Bearer nope.nope").get("/api/v1/tenant")
    assert body.status_code == 401
    assert body.json()["error"]["code"] == "invalid_api_key"


def test_openapi_schema_is_served():
    response = APIClient().get("/api/schema/", HTTP_ACCEPT="application/json")
    assert response.status_code == 200
    paths = response.json()["paths"]
    assert "/api/v1/keys/{key_id}/rotate" in paths and "/api/v1/members" in paths
