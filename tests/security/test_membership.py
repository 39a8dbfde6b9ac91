"""Membership by invitation: an admin can not pull another tenant's user in, nor learn who exists."""

import re

import pytest
from django.core import mail
from rest_framework.test import APIClient

from tenancy.models import Membership
from tests.platform.conftest import client_for_member
from tests.platform.factories import MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db


def test_an_admin_can_not_add_another_tenants_user_by_name_or_address(tenant_a, tenant_b, member_client):
    client, _ = member_client(tenant_a, "admin")
    victim = MembershipFactory(tenant=tenant_b, role="owner", user=UserFactory(username="bob", email="bob@b.test"))
    by_name = client.post("/api/v1/members", {"username": "bob", "role": "developer"}, format="json")
    by_address = client.post("/api/v1/members", {"email": "bob@b.test", "role": "developer"}, format="json")
    assert by_name.status_code == 400
    assert by_address.status_code == 201
    assert not Membership.objects.filter(tenant=tenant_a, user=victim.user).exists()
    for response in (by_name, by_address):
        assert "bob@b.test" not in response.content.decode().replace('"email":"bob@b.test"', "")
        assert "tenant-b" not in response.content.decode()


def test_errors_and_answers_do_not_tell_which_accounts_exist(tenant_a, tenant_b, member_client):
    client, _ = member_client(tenant_a, "admin")
    UserFactory(username="carol", email="carol@b.test")
    known = client.post("/api/v1/members", {"email": "carol@b.test", "role": "viewer"}, format="json").json()
    unknown = client.post("/api/v1/members", {"email": "nobody@b.test", "role": "viewer"}, format="json").json()
    assert set(known) == set(unknown)
    strip = {"id", "email", "created_at", "expires_at", "accept_url"}
    assert {k: v for k, v in known.items() if k not in strip} == {k: v for k, v in unknown.items() if k not in strip}
    by_known = client.post("/api/v1/members", {"username": "carol", "role": "viewer"}, format="json").json()
    by_unknown = client.post("/api/v1/members", {"username": "zed-never", "role": "viewer"}, format="json").json()
    assert by_known == by_unknown


def test_the_invitee_accepts_with_the_link_and_joins_with_the_invited_role(
    tenant_a, member_client, django_capture_on_commit_callbacks
):
    admin_client, _ = member_client(tenant_a, "admin")
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post("/api/v1/members", {"email": "dana@new.test", "role": "developer"}, format="json")
    link = response.json()["accept_url"]
    assert len(mail.outbox) == 1 and link in mail.outbox[0].body and mail.outbox[0].to == ["dana@new.test"]
    assert not Membership.objects.filter(tenant=tenant_a, user__email="dana@new.test").exists()
    path = re.sub(r"^https?://[^/]+", "", link)
    anonymous = APIClient()
    assert anonymous.get(path).json()["role"] == "developer"
    joined = anonymous.post(path, {"username": "dana", "password": "a-long-enough-passphrase-42"}, format="json")
    assert joined.status_code == 201, joined.content
    assert Membership.objects.get(tenant=tenant_a, user__username="dana").role == "developer"
    again = anonymous.post(path, {"username": "dana2", "password": "a-long-enough-passphrase-42"}, format="json")
    assert again.status_code == 404 and again.json()["error"]["code"] == "invalid_invitation"  # used: no such invitation


def test_an_existing_user_accepts_into_their_own_account(tenant_a, tenant_b, member_client):
    admin_client, _ = member_client(tenant_a, "admin")
    bob = MembershipFactory(tenant=tenant_b, role="viewer").user
    link = admin_client.post("/api/v1/members", {"email": bob.email, "role": "viewer"}, format="json").json()["accept_url"]
    path = re.sub(r"^https?://[^/]+", "", link)
    client = APIClient(enforce_csrf_checks=False)
    client.force_login(bob, backend="django.contrib.auth.backends.ModelBackend")
    assert client.post(path, {}, format="json").status_code == 201
    assert Membership.objects.filter(tenant=tenant_a, user=bob, role="viewer").exists()


def test_a_forged_token_is_refused_like_a_used_one(tenant_a):
    response = APIClient().post("/api/v1/invitations/not-a-token", {"username": "x", "password": "y" * 20}, format="json")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "invalid_invitation"
    assert not Membership.objects.filter(tenant=tenant_a).exists()


def test_members_of_other_tenants_are_not_listed_or_reachable(tenant_a, tenant_b, member_client):
    client, _ = member_client(tenant_a, "admin")
    other = MembershipFactory(tenant=tenant_b, role="owner")
    listed = client.get("/api/v1/members").json()
    assert other.user.email not in str(listed)
    assert client.get(f"/api/v1/members/{other.pk}").status_code == 404
    assert client_for_member(other).get("/api/v1/invitations").json()["count"] == 0
