"""Members in the console: invite by email (then accept, with a new account), revoke, roles, the owner rules."""

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


def _flash(response) -> str:
    text = re.search(rb"Invited \S+@[^<]*", response.content).group(0).decode()
    return re.sub(r"\S+@\S+", "ADDRESS", text)


def test_the_invite_form_answers_alike_whether_or_not_the_address_has_an_account(tenant, member_of):
    client, _ = member_of(tenant, "admin")
    UserFactory(username="bob", email="bob@elsewhere.test")
    known = client.post(members_url(tenant), {"email": "bob@elsewhere.test", "role": "viewer"}, follow=True)
    unknown = client.post(members_url(tenant), {"email": "nobody@elsewhere.test", "role": "viewer"}, follow=True)
    assert known.status_code == unknown.status_code == 200
    assert _flash(known) == _flash(unknown) == "Invited ADDRESS as viewer. This server doesn't deliver email, so " \
        "send them this link to accept: "
    assert b"bob@elsewhere.test" in unknown.content and b"nobody@elsewhere.test" in unknown.content  # both pending
    assert Membership.objects.filter(tenant=tenant).count() == 1


def test_an_invited_person_accepts_with_a_new_account_and_logs_in(
    tenant, member_of, client, django_capture_on_commit_callbacks
):
    admin_client, _ = member_of(tenant, "admin")
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(members_url(tenant), {"email": "new@acme.test", "role": "viewer"}, follow=True)
    assert b"Invited new@acme.test" in response.content
    assert len(mail.outbox) == 1 and mail.outbox[0].to == ["new@acme.test"]
    link = re.search(rb'data-testid="invite-link">http://testserver(/invitations/[^<]+)</code>', response.content)
    link = link.group(1).decode()
    assert f"Accept here: http://localhost:8000{link}" in mail.outbox[0].body
    page = client.get(link)
    assert page.status_code == 200 and b"Join Acme" in page.content and b"Log in to accept" in page.content
    weak = client.post(link, {"username": "newbie", "password": "123"})
    assert weak.status_code == 400 and not Membership.objects.filter(user__username="newbie").exists()
    done = client.post(link, {"username": "newbie", "password": "a-long-enough-passphrase-42"})
    assert done.url == reverse("console:tenant-overview", kwargs={"slug": tenant.slug})
    assert Membership.objects.get(tenant=tenant, user__username="newbie").role == "viewer"
    assert client.get(done.url).status_code == 200
    assert client.get(link).status_code == 404
    assert b"not valid, was already used" in client.get(link).content


def test_a_revoked_invitation_link_stops_working(tenant, member_of, client):
    admin_client, _ = member_of(tenant, "admin")
    response = admin_client.post(members_url(tenant), {"email": "late@acme.test", "role": "viewer"}, follow=True)
    link = re.search(rb"http://testserver(/invitations/[^<]+)</code>", response.content).group(1).decode()
    invitation = Invitation.objects.get(email="late@acme.test")
    revoke = reverse("console:invitation-revoke", kwargs={"slug": tenant.slug, "invitation_id": invitation.pk})
    page = admin_client.post(revoke, follow=True)
    assert b"Revoked the invitation to late@acme.test" in page.content
    assert b'data-invitation="late@acme.test"' not in page.content
    assert client.get(link).status_code == 404
    assert AuditLog.objects.filter(action="member.invite_revoke", tenant=tenant).exists()


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
