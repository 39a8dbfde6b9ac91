"""Log-in (throttled by django-axes) and the audit log's filters."""

from datetime import timedelta

import pytest
from django.test import override_settings
from django.urls import reverse
from django.utils import timezone

from apikeys.services import api_key_create
from tenancy.audit import Actor
from tenancy.models import AuditLog
from tests.platform.factories import MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db
PASSWORD = "pw-12345-secret"


def test_logging_in_lands_on_the_users_tenant(tenant, member_of, client):
    _, membership = member_of(tenant, "developer")
    response = client.post(reverse("console:login"), {"username": membership.user.username, "password": PASSWORD})
    assert response.status_code == 302
    assert client.get(response.url).url == reverse("console:tenant-overview", kwargs={"slug": tenant.slug})


def test_a_wrong_password_says_so(client):
    UserFactory(username="dana")
    response = client.post(reverse("console:login"), {"username": "dana", "password": "nope"})
    assert response.status_code == 200 and b"Please enter a correct username and password" in response.content


@override_settings(AXES_ENABLED=True, AXES_FAILURE_LIMIT=3)
def test_repeated_failures_lock_the_account_even_for_the_right_password(client):
    UserFactory(username="dana")
    for _ in range(3):
        client.post(reverse("console:login"), {"username": "dana", "password": "guess"}, REMOTE_ADDR="10.1.2.3")
    locked = client.post(reverse("console:login"), {"username": "dana", "password": PASSWORD}, REMOTE_ADDR="10.1.2.3")
    assert locked.status_code == 429
    assert b"Too many failed log-ins" in locked.content
    assert "_auth_user_id" not in client.session


def test_the_tenant_audit_log_filters_by_actor_action_and_date(tenant, member_of):
    client, admin = member_of(tenant, "admin")
    other = MembershipFactory(tenant=tenant, user=UserFactory(username="zed"), role="developer").user
    api_key_create(actor=Actor(user=admin.user), tenant=tenant, name="a", scopes=["inference"])
    api_key_create(actor=Actor(user=other), tenant=tenant, name="b", scopes=["inference"])
    old = AuditLog.objects.filter(actor_user=other).get()
    AuditLog.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=40))
    url = reverse("console:audit", kwargs={"slug": tenant.slug})

    def actions(query: str) -> list[tuple[str, str]]:
        rows = client.get(url + query).context["entries"].rows
        return [(row.actor_user.username if row.actor_user else "system", row.action) for row in rows]

    assert ("zed", "api_key.create") in actions("")
    assert actions("?actor=zed") == [("zed", "api_key.create")]
    assert all(action.startswith("api_key") for _, action in actions("?action=api_key"))
    since = (timezone.now() - timedelta(days=7)).date().isoformat()
    assert ("zed", "api_key.create") not in actions(f"?since={since}")
    assert client.get(url + "?since=not-a-date").status_code == 200
    for query in ("?until=9999-12-31", "?since=0001-01-01"):
        page = client.get(url + query)
        assert page.status_code == 200 and "Choose a date between 1970-01-01 and 9998-12-31." in page.content.decode()


def test_staff_see_every_tenants_audit_and_members_only_their_own(tenant, other_tenant, member_of, staff_client):
    client, _ = member_of(tenant, "admin")
    api_key_create(actor=Actor.system(), tenant=other_tenant, name="theirs", scopes=["inference"])
    mine = client.get(reverse("console:audit", kwargs={"slug": tenant.slug})).context["entries"].rows
    assert all(row.tenant_id == tenant.pk for row in mine)
    platform = staff_client.get(reverse("console:platform-audit") + "?tenant=globex").context["entries"].rows
    assert platform and all(row.tenant_id == other_tenant.pk for row in platform)
    assert list(staff_client.get(reverse("console:platform-audit") + "?tenant=nope").context["entries"].rows) == []


def test_audit_entries_name_what_they_touched(tenant, member_of, base_model, adapter_zips):
    from django.core.files.uploadedfile import SimpleUploadedFile

    from registry.services import adapter_create
    from tenancy.models import Plan
    from tenancy.services import tenant_update
    from tests.console.builders import BASE_NAME

    client, _ = member_of(tenant, "admin")
    pro = Plan.objects.create(slug="pro", name="Pro")
    before = tenant.plan.name
    tenant_update(actor=Actor.system(), tenant=tenant, changes={"plan": pro})
    adapter_create(actor=Actor.system(), tenant=tenant, name="support-bot", base_model=BASE_NAME, enqueue=False,
                   files=[SimpleUploadedFile("a.zip", adapter_zips[0])])  # fmt: skip
    page = client.get(reverse("console:audit", kwargs={"slug": tenant.slug})).content.decode()
    assert f'<s class="muted">{before}</s> → Pro' in page
    assert "Adapter support-bot" in page and "Tenant Acme Corp" in page
    assert "Adapter #" not in page and "plan:</span> <s class=\"muted\">1" not in page


def test_a_form_sent_after_the_session_ended_comes_back_to_its_page_after_logging_in(tenant, member_of, client):
    _, membership = member_of(tenant, "owner")
    key, _ = api_key_create(actor=Actor.system(), tenant=tenant, name="svc", scopes=["inference"])
    keys_page = reverse("console:keys", kwargs={"slug": tenant.slug})
    revoke = reverse("console:key-revoke", kwargs={"slug": tenant.slug, "prefix": key.prefix})
    sent = client.post(revoke, HTTP_REFERER=f"http://testserver{keys_page}?sort=name")
    assert sent.status_code == 302 and sent.url == reverse("console:login") + "?next=/t/acme/keys/%3Fsort%3Dname"
    login = client.post(sent.url, {"username": membership.user.username, "password": PASSWORD})
    landed = client.get(login.url)
    assert login.url == f"{keys_page}?sort=name" and landed.status_code == 200  # the page, not a 405 on the action
    key.refresh_from_db()
    assert not key.revoked
    elsewhere = client.logout() or client.post(revoke, HTTP_REFERER="https://evil.test/t/acme/keys/")
    assert elsewhere.url == reverse("console:login")


def test_an_upload_sent_after_the_session_ended_gets_a_message_the_upload_form_shows(tenant, client):
    upload = reverse("console:adapter-upload", kwargs={"slug": tenant.slug})
    response = client.post(upload, {"name": "x"}, HTTP_X_REQUESTED_WITH="XMLHttpRequest")
    assert response.status_code == 401
    assert response.json() == {"errors": ["Your session has ended. Log in again, then upload."]}


def test_a_form_whose_csrf_token_went_stale_gets_the_consoles_page_with_a_way_back(tenant, member_of):
    client, _ = member_of(tenant, "owner")
    client.handler.enforce_csrf_checks = True
    keys_page = reverse("console:keys", kwargs={"slug": tenant.slug})
    client.get(keys_page)
    client.cookies["csrftoken"] = "x" * 32  # logged out and in again in another tab: a new token
    response = client.post(keys_page, {"name": "svc", "scopes": ["inference"], "csrfmiddlewaretoken": "y" * 32},
                           HTTP_REFERER=f"http://testserver{keys_page}")  # fmt: skip
    body = response.content.decode()
    assert response.status_code == 403
    assert "This form expired" in body and f'href="{keys_page}"' in body and "<title>Form expired · Quilt" in body
    upload = reverse("console:adapter-upload", kwargs={"slug": tenant.slug})
    refused = client.post(upload, {"name": "x", "csrfmiddlewaretoken": "y" * 32}, HTTP_X_REQUESTED_WITH="XMLHttpRequest",
                          HTTP_REFERER=f"http://testserver{upload}")  # fmt: skip
    assert refused.status_code == 403 and "This form expired" in refused.json()["errors"][0]


def test_opening_the_logout_url_says_to_use_the_button_and_keeps_the_session(tenant, member_of):
    """Django's LogoutView answers only POST: /logout/ typed in the address bar was a blank 405."""
    client, _ = member_of(tenant, "viewer")
    response = client.get(reverse("console:logout"))
    assert response.status_code == 405 and response["Allow"] == "POST"
    assert b"This action runs from its button" in response.content and b'href="/"' in response.content
    assert client.get(reverse("console:keys", kwargs={"slug": tenant.slug})).status_code == 200
    assert client.post(reverse("console:logout")).status_code == 302
    assert client.get(reverse("console:keys", kwargs={"slug": tenant.slug})).status_code == 302


def test_a_pending_invitation_is_named_by_its_email_not_as_deleted(tenant, member_of):
    from tenancy.invitations import invitation_create, invitation_revoke

    client, membership = member_of(tenant, "owner")
    pending, _ = invitation_create(actor=Actor(user=membership.user), tenant=tenant, email="new@acme.test",
                                   role="viewer")  # fmt: skip
    revoked, _ = invitation_create(actor=Actor(user=membership.user), tenant=tenant, email="gone@acme.test",
                                   role="viewer")  # fmt: skip
    invitation_revoke(actor=Actor(user=membership.user), invitation=revoked)
    page = client.get(reverse("console:audit", kwargs={"slug": tenant.slug})).content.decode()
    assert "Invitation new@acme.test" in page and "Invitation gone@acme.test" in page
    assert "Invitation (deleted)" not in page
