"""API keys in the console: the secret is shown once, scopes and expiry stick, revoke and rotate work."""

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from apikeys.models import ApiKey
from apikeys.selectors import KeyRefused, api_key_authenticate
from apikeys.services import api_key_create
from tenancy.audit import Actor
from tenancy.models import AuditLog

pytestmark = pytest.mark.django_db


def keys_url(tenant, *parts) -> str:
    return reverse("console:keys", kwargs={"slug": tenant.slug}) + "".join(parts)


def test_creating_a_key_shows_the_secret_once(tenant, member_of):
    client, membership = member_of(tenant, "developer")
    posted = client.post(keys_url(tenant), {"name": "backend", "scopes": ["inference", "usage:read"], "expiry": "30"})
    assert posted.status_code == 302 and posted["Location"] == keys_url(tenant)
    response = client.get(keys_url(tenant))
    assert response.status_code == 200
    assert response["Cache-Control"] == "no-store"
    secret = response.context["created"]["plaintext"]
    assert secret.encode() in response.content
    assert b"shown only once" in response.content
    key = api_key_authenticate(presented=secret)
    assert key.tenant == tenant and key.scopes == ["inference", "usage:read"] and key.created_by == membership.user
    assert timedelta(days=29) < key.expiry_date - timezone.now() <= timedelta(days=30)
    assert secret.encode() not in client.get(keys_url(tenant)).content
    assert AuditLog.objects.filter(action="api_key.create", actor_user=membership.user).count() == 1
    assert ApiKey.objects.filter(tenant=tenant).count() == 1


def test_a_second_active_key_with_the_same_name_is_refused(tenant, member_of):
    client, _ = member_of(tenant, "developer")
    api_key_create(actor=Actor.system(), tenant=tenant, name="Backend", scopes=["inference"])
    response = client.post(keys_url(tenant), {"name": "backend ", "scopes": ["inference"]})
    assert response.status_code == 400
    assert "A key named “backend” already exists" in response.content.decode()
    assert ApiKey.objects.filter(tenant=tenant).count() == 1


def test_a_key_without_scopes_is_refused_with_a_message(tenant, member_of):
    client, _ = member_of(tenant, "developer")
    response = client.post(keys_url(tenant), {"name": "backend"})
    assert response.status_code == 400
    assert b"This field is required" in response.content
    assert not ApiKey.objects.exists()


def test_revoking_stops_the_key(tenant, member_of):
    client, _ = member_of(tenant, "developer")
    key, secret = api_key_create(actor=Actor.system(), tenant=tenant, name="old", scopes=["inference"])
    response = client.post(reverse("console:key-revoke", kwargs={"slug": tenant.slug, "prefix": key.prefix}), follow=True)
    assert b"is revoked" in response.content
    with pytest.raises(KeyRefused, match="revoked"):
        api_key_authenticate(presented=secret)


@pytest.mark.parametrize("action", ["key-revoke", "key-rotate"])
def test_an_action_url_opened_with_get_is_the_consoles_page_leading_back_to_the_keys(tenant, member_of, action):
    """A Revoke or Rotate URL opened from history or pasted: not a blank 405, and nothing changes."""
    client, _ = member_of(tenant, "developer")
    key, secret = api_key_create(actor=Actor.system(), tenant=tenant, name="old", scopes=["inference"])
    response = client.get(reverse(f"console:{action}", kwargs={"slug": tenant.slug, "prefix": key.prefix}))
    assert response.status_code == 405 and response["Allow"] == "POST"
    assert response["Content-Type"].startswith("text/html")
    assert b"This action runs from its button" in response.content
    assert f'href="{keys_url(tenant)}"'.encode() in response.content
    assert api_key_authenticate(presented=secret) == key
    api = client.get(f"/api/v1/keys/{key.pk}/revoke")  # the management API keeps its JSON errors
    assert api.status_code == 405 and api.json()["error"]["type"]


def test_rotating_issues_a_successor_and_keeps_the_old_key_for_the_grace_period(tenant, member_of):
    client, _ = member_of(tenant, "developer")
    key, old_secret = api_key_create(actor=Actor.system(), tenant=tenant, name="svc", scopes=["inference"])
    url = reverse("console:key-rotate", kwargs={"slug": tenant.slug, "prefix": key.prefix})
    response = client.post(url, {"grace": "3600"}, follow=True)
    new_secret = response.context["created"]["plaintext"]
    assert new_secret.encode() in response.content and b"keeps working until" in response.content
    assert api_key_authenticate(presented=new_secret).name == "svc"
    key.refresh_from_db()
    assert timedelta(minutes=59) < key.expiry_date - timezone.now() <= timedelta(hours=1)
    assert key.replaced_by.prefix == new_secret.partition(".")[0]
    assert api_key_authenticate(presented=old_secret).pk == key.pk
    again = client.post(url, {"grace": "0"}, follow=True)
    assert b"already been rotated" in again.content


def test_viewers_see_keys_but_can_not_change_them(tenant, member_of):
    client, _ = member_of(tenant, "viewer")
    key, _ = api_key_create(actor=Actor.system(), tenant=tenant, name="svc", scopes=["inference"])
    page = client.get(keys_url(tenant)).content.decode()
    assert "svc" in page and 'data-testid="create-key"' not in page and "/revoke/" not in page and "/rotate/" not in page
    assert client.post(keys_url(tenant), {"name": "x", "scopes": ["inference"]}).status_code == 403
    kwargs = {"slug": tenant.slug, "prefix": key.prefix}
    assert client.post(reverse("console:key-revoke", kwargs=kwargs)).status_code == 403
    assert client.post(reverse("console:key-rotate", kwargs=kwargs), {"grace": "0"}).status_code == 403
    key.refresh_from_db()
    assert not key.revoked and ApiKey.objects.count() == 1


def test_keys_of_another_tenant_are_not_found(tenant, other_tenant, member_of):
    client, _ = member_of(tenant, "owner")
    key, _ = api_key_create(actor=Actor.system(), tenant=other_tenant, name="theirs", scopes=["inference"])
    url = reverse("console:key-revoke", kwargs={"slug": tenant.slug, "prefix": key.prefix})
    assert client.post(url).status_code == 404
    key.refresh_from_db()
    assert not key.revoked


def test_the_key_list_pages_sorts_and_filters_in_a_fixed_number_of_queries(
    tenant, member_of, django_assert_max_num_queries
):
    client, _ = member_of(tenant, "developer")
    for index in range(60):
        api_key_create(actor=Actor.system(), tenant=tenant, name=f"key-{index:02d}", scopes=["inference"])
    ApiKey.objects.filter(name__in=["key-00", "key-01"]).update(revoked=True)
    with django_assert_max_num_queries(12):
        page = client.get(keys_url(tenant, "?sort=name&page=2"))
    names = [key.name for key in page.context["keys"].rows]
    assert names == [f"key-{index:02d}" for index in range(25, 50)]
    revoked = client.get(keys_url(tenant, "?state=revoked")).context["keys"]
    assert [key.name for key in revoked.rows] == ["key-01", "key-00"]


def test_a_developer_is_offered_only_the_scopes_their_role_may_give_and_keeps_what_they_typed(tenant, member_of):
    client, _ = member_of(tenant, "developer")
    page = client.get(keys_url(tenant, "?new=1")).content.decode()
    assert 'value="inference"' in page and 'value="usage:read"' in page
    assert 'name="scopes" value="admin"' not in page
    response = client.post(keys_url(tenant), {"name": "ci", "scopes": ["inference", "admin"], "allowed_models": "shout"})
    assert response.status_code == 400
    body = response.content.decode()
    assert 'value="ci"' in body and 'value="shout"' in body
    assert "Your role can not give a key the admin scope." in body
    assert not ApiKey.objects.exists()


def test_owners_and_staff_may_give_the_admin_scope(tenant, member_of, staff_client):
    owner, _ = member_of(tenant, "owner")
    assert 'name="scopes" value="admin"' in owner.get(keys_url(tenant, "?new=1")).content.decode()
    assert 'name="scopes" value="admin"' in staff_client.get(keys_url(tenant, "?new=1")).content.decode()
    assert owner.post(keys_url(tenant), {"name": "ops", "scopes": ["admin"]}).status_code == 302
    assert ApiKey.objects.get(name="ops").scopes == ["admin"]


def test_a_developer_is_not_offered_to_revoke_or_rotate_an_admin_key_and_gets_a_message_if_they_try(tenant, member_of):
    client, _ = member_of(tenant, "developer")
    admin_key, _ = api_key_create(actor=Actor.system(), tenant=tenant, name="ops", scopes=["admin"])
    own_key, _ = api_key_create(actor=Actor.system(), tenant=tenant, name="svc", scopes=["inference"])
    page = client.get(keys_url(tenant)).content.decode()
    assert f"/keys/{own_key.prefix}/revoke/" in page and f"/keys/{own_key.prefix}/rotate/" in page
    assert f"/keys/{admin_key.prefix}/revoke/" not in page and f"/keys/{admin_key.prefix}/rotate/" not in page
    kwargs = {"slug": tenant.slug, "prefix": admin_key.prefix}
    for action, data in (("console:key-revoke", {}), ("console:key-rotate", {"grace": "0"})):
        response = client.post(reverse(action, kwargs=kwargs), data, follow=True)
        assert response.status_code == 200 and response.redirect_chain == [(keys_url(tenant), 302)]
        assert "does not allow keys with the scopes: admin" in response.content.decode()
    admin_key.refresh_from_db()
    assert not admin_key.revoked and admin_key.replaced_by_id is None and ApiKey.objects.count() == 2
