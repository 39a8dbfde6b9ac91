"""Attacks on the role ladder: every one of them must fail. Roles are a ceiling for keys, a key is never an owner."""

import pytest

from apikeys.models import ApiKey
from tenancy.models import AuditLog, Membership
from tests.platform.conftest import client_for_key
from tests.platform.factories import MembershipFactory, make_key

pytestmark = pytest.mark.django_db


def test_a_developer_can_not_mint_an_admin_key_and_crown_themselves_owner(tenant_a, member_client):
    client, developer = member_client(tenant_a, "developer")
    MembershipFactory(tenant=tenant_a, role="owner")
    response = client.post("/api/v1/keys", {"name": "mine", "scopes": ["admin"]}, format="json")
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "insufficient_role"
    assert not ApiKey.objects.filter(scopes__contains=["admin"]).exists()
    # The same through a key the developer may hold: a key never mints wider than its creator's role.
    response = client.post("/api/v1/keys", {"name": "mine", "scopes": ["inference", "adapters:write"]}, format="json")
    assert response.status_code == 201
    key_client = client_for_key(response.json()["key"])
    assert key_client.post("/api/v1/keys", {"name": "x", "scopes": ["admin"]}, format="json").status_code == 403
    assert key_client.patch(f"/api/v1/members/{developer.pk}", {"role": "owner"}, format="json").status_code == 403
    developer.refresh_from_db()
    assert developer.role == "developer"


def test_a_viewer_mints_only_read_keys(tenant_a, member_client):
    client, _ = member_client(tenant_a, "viewer")
    response = client.post("/api/v1/keys", {"name": "x", "scopes": ["inference"]}, format="json")
    assert response.status_code == 403
    assert not ApiKey.objects.exists()


def test_an_admin_key_is_not_an_owner(tenant_a, member_client):
    _, admin = member_client(tenant_a, "admin")
    owner_client, owner = member_client(tenant_a, "owner")
    key, plaintext = make_key(tenant_a, scopes=["admin"], created_by=admin.user)
    client = client_for_key(plaintext)
    assert client.patch(f"/api/v1/members/{admin.pk}", {"role": "owner"}, format="json").status_code == 403
    assert client.patch(f"/api/v1/members/{owner.pk}", {"role": "viewer"}, format="json").status_code == 403
    assert client.delete(f"/api/v1/members/{owner.pk}").status_code == 403
    response = client.post("/api/v1/members", {"email": "friend@evil.test", "role": "owner"}, format="json")
    assert response.status_code == 403
    assert response.json()["error"]["type"] == "permission_error"
    assert set(Membership.objects.filter(tenant=tenant_a).values_list("role", flat=True)) == {"admin", "owner"}
    # Even an admin key made by the owner is capped at admin.
    _, by_owner = make_key(tenant_a, scopes=["admin"], created_by=owner.user)
    assert client_for_key(by_owner).patch(
        f"/api/v1/members/{admin.pk}", {"role": "owner"}, format="json"
    ).status_code == 403


def test_a_demoted_creator_takes_their_keys_power_with_them(tenant_a, member_client):
    owner_client, _ = member_client(tenant_a, "owner")
    admin_client, admin = member_client(tenant_a, "admin")
    plaintext = admin_client.post("/api/v1/keys", {"name": "ops", "scopes": ["admin"]}, format="json").json()["key"]
    victim = MembershipFactory(tenant=tenant_a, role="developer")
    assert owner_client.patch(f"/api/v1/members/{admin.pk}", {"role": "developer"}, format="json").status_code == 200
    response = client_for_key(plaintext).patch(f"/api/v1/members/{victim.pk}", {"role": "viewer"}, format="json")
    assert response.status_code == 403
    victim.refresh_from_db()
    assert victim.role == "developer"


def test_rotating_a_wider_key_does_not_hand_over_its_scopes(tenant_a, member_client):
    _, owner = member_client(tenant_a, "owner")
    client, _ = member_client(tenant_a, "developer")
    key, _ = make_key(tenant_a, scopes=["admin"], created_by=owner.user)
    response = client.post(f"/api/v1/keys/{key.prefix}/rotate", {"grace_seconds": 0}, format="json")
    assert response.status_code == 403
    assert "key" not in response.json()
    assert ApiKey.objects.count() == 1


def test_owner_grants_are_checked_in_the_service(tenant_a, member_client):
    """The rule lives in the service: calling it directly as an admin is refused the same way."""
    from tenancy.audit import Actor
    from tenancy.authority import NotAllowed
    from tenancy.services import member_change_role

    _, admin = member_client(tenant_a, "admin")
    target = MembershipFactory(tenant=tenant_a, role="developer")
    with pytest.raises(NotAllowed):
        member_change_role(actor=Actor(user=admin.user), membership=target, role="owner")
    assert not AuditLog.objects.filter(action="member.change_role").exists()


def test_a_removed_creators_inference_key_stops_at_the_gateway(tenant_a, member_client):
    from gateway.caller import caller_authenticate
    from gateway.errors import ApiError

    owner_client, _ = member_client(tenant_a, "owner")
    developer_client, developer = member_client(tenant_a, "developer")
    plaintext = developer_client.post("/api/v1/keys", {"name": "ci", "scopes": ["inference"]}, format="json").json()["key"]
    caller_authenticate(authorization=f"Bearer {plaintext}")
    assert owner_client.delete(f"/api/v1/members/{developer.pk}").status_code == 204
    with pytest.raises(ApiError) as refused:
        caller_authenticate(authorization=f"Bearer {plaintext}")
    assert refused.value.status == 403 and refused.value.code == "insufficient_role"
