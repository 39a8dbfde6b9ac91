"""Members in the console: add, invite by email (then set a password and log in), roles, the owner rules."""

import re

import pytest
from django.core import mail
from django.urls import reverse

from tenancy.models import AuditLog, Invitation, Membership
from tests.platform.factories import MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db


def members_url(tenant) -> str:
    return reverse("console:members", kwargs={"slug": tenant.slug})


def member_url(name: str, membership) -> str:
    return reverse(f"console:{name}", kwargs={"slug": membership.tenant.slug, "member_id": membership.pk})


def test_an_admin_cannot_add_an_existing_user_only_invite_them(tenant, member_of):
    client, admin = member_of(tenant, "admin")
    UserFactory(username="bob", email="bob@elsewhere.test")
    refused = client.post(members_url(tenant), {"username": "bob", "role": "developer"}, follow=True)
    assert refused.status_code == 400 and b"Members join by invitation" in refused.content
    client.post(members_url(tenant), {"email": "bob@elsewhere.test", "role": "developer"}, follow=True)
    assert not Membership.objects.filter(tenant=tenant, user__username="bob").exists()
    invitation = Invitation.objects.get(tenant=tenant)
    assert (invitation.email, invitation.role, invitation.accepted_at) == ("bob@elsewhere.test", "developer", None)
    assert AuditLog.objects.filter(action="member.invite", actor_user=admin.user, tenant=tenant).exists()
    assert not AuditLog.objects.filter(action="member.add", tenant=tenant, actor_user=admin.user).exists()


def test_an_invited_person_sets_a_password_from_the_email_and_logs_in(tenant, member_of, client):
    admin_client, _ = member_of(tenant, "admin")
    response = admin_client.post(members_url(tenant), {"email": "new@acme.test", "role": "viewer"}, follow=True)
    assert b"Invited new@acme.test" in response.content
    assert len(mail.outbox) == 1 and mail.outbox[0].to == ["new@acme.test"]
    link = re.search(r"http://testserver(/welcome/\S+)", mail.outbox[0].body).group(1)
    assert f'data-testid="invite-link">http://testserver{link}</code>'.encode() in response.content, "no inbox here"
    form_page = client.get(link, follow=True)
    assert b"Choose a password" in form_page.content
    password = "a-long-enough-passphrase-42"
    done = client.post(form_page.redirect_chain[-1][0], {"new_password1": password, "new_password2": password})
    assert done.status_code == 302
    assert client.login(username="new@acme.test", password=password)
    assert client.get(reverse("console:tenant-overview", kwargs={"slug": tenant.slug})).status_code == 200
    assert client.get(link, follow=True).content.count(b"This link has expired") == 1


def test_where_email_reaches_inboxes_the_link_stays_in_the_email(tenant, member_of, settings):
    from console import invitations

    admin_client, _ = member_of(tenant, "admin")
    invitations.UNDELIVERED_BACKENDS.discard(settings.EMAIL_BACKEND)
    try:
        response = admin_client.post(members_url(tenant), {"email": "far@acme.test", "role": "viewer"}, follow=True)
    finally:
        invitations.UNDELIVERED_BACKENDS.add(settings.EMAIL_BACKEND)
    assert b"they will get an email" in response.content and b"invite-link" not in response.content


def test_roles_change_and_only_owners_touch_owners(tenant, member_of):
    client, admin = member_of(tenant, "admin")
    developer = MembershipFactory(tenant=tenant, role="developer")
    owner = MembershipFactory(tenant=tenant, role="owner")
    client.post(member_url("member-role", developer), {"role": "viewer"})
    developer.refresh_from_db()
    assert developer.role == "viewer"
    assert client.post(member_url("member-role", developer), {"role": "owner"}).status_code == 403
    assert client.post(member_url("member-role", owner), {"role": "viewer"}).status_code == 403
    assert client.post(member_url("member-remove", owner)).status_code == 403
    assert client.post(members_url(tenant), {"username": UserFactory().username, "role": "owner"}).status_code == 403
    owner.refresh_from_db()
    assert owner.role == "owner"


def test_the_last_owner_stays(tenant, member_of):
    client, owner = member_of(tenant, "owner")
    response = client.post(member_url("member-role", owner), {"role": "admin"}, follow=True)
    assert b"must keep at least one owner" in response.content
    owner.refresh_from_db()
    assert owner.role == "owner"


def test_removing_a_member_takes_their_access(tenant, member_of):
    client, _ = member_of(tenant, "owner")
    leaving_client, leaving = member_of(tenant, "developer")
    response = client.post(member_url("member-remove", leaving), follow=True)
    assert b"Removed" in response.content
    assert leaving_client.get(reverse("console:keys", kwargs={"slug": tenant.slug})).status_code == 404


def test_developers_can_not_manage_members(tenant, member_of):
    client, _ = member_of(tenant, "developer")
    other = MembershipFactory(tenant=tenant, role="viewer")
    assert client.post(members_url(tenant), {"username": UserFactory().username, "role": "viewer"}).status_code == 403
    assert client.post(member_url("member-role", other), {"role": "admin"}).status_code == 403
    assert client.post(member_url("member-remove", other)).status_code == 403
    assert Membership.objects.filter(tenant=tenant).count() == 2


def test_the_member_list_pages_in_a_fixed_number_of_queries(tenant, member_of, django_assert_max_num_queries):
    client, _ = member_of(tenant, "admin")
    MembershipFactory.create_batch(60, tenant=tenant, role="viewer")
    with django_assert_max_num_queries(12):
        response = client.get(members_url(tenant) + "?sort=-username&page=3")
    assert len(response.context["members"].rows) == 11
