"""Invitations in a real browser: an admin invites an address, another user opens the link and accepts."""

import pytest

from tenancy.models import Invitation, Membership
from tests.console.test_browser import log_in
from tests.platform.factories import MembershipFactory, TenantFactory, UserFactory

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_an_admin_invites_and_another_user_accepts(browser, live_server_asgi):
    server = live_server_asgi
    tenant = TenantFactory(slug="acme", name="Acme Corp")
    MembershipFactory(tenant=tenant, user=UserFactory(username="dana"), role="admin")
    UserFactory(username="bob", email="bob@elsewhere.test")
    admin = log_in(browser, server, "dana")
    admin.goto(f"{server.url}/t/acme/members/")
    admin.click("[data-testid=add-member]")
    admin.fill("#id_email", "bob@elsewhere.test")
    admin.select_option("#id_role", "developer")
    admin.click("[data-testid=invite-submit]")
    link = admin.locator("[data-testid=invite-link]").inner_text()
    assert "/invitations/" in link
    assert admin.locator("tr[data-invitation='bob@elsewhere.test']").is_visible()

    invitee = log_in(browser, server, "bob")
    invitee.goto(link)
    assert "Join Acme Corp" in invitee.locator("h1").inner_text()
    invitee.click("[data-testid=invitation-accept]")
    invitee.wait_for_url(f"{server.url}/t/acme/")
    assert "You joined Acme Corp as developer" in invitee.content()
    assert Membership.objects.get(tenant=tenant, user__username="bob").role == "developer"
    assert Invitation.objects.get(email="bob@elsewhere.test").accepted_by.username == "bob"

    admin.reload()
    assert admin.locator("tr[data-invitation='bob@elsewhere.test']").count() == 0
    assert admin.locator("tr[data-member='bob']").is_visible()
