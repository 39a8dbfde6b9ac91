"""The console's live-update socket in a real browser against the ASGI server: it comes back after a drop, and
stops for good once the server refuses it (the member was removed, or logged out elsewhere)."""

import pytest

from tenancy.models import Membership
from tests.console.test_browser import log_in
from tests.platform.factories import MembershipFactory, TenantFactory, UserFactory

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# Test-side instrumentation: keep every socket the page opens, so the test can count them and drop one.
KEEP_SOCKETS = """
window.__sockets = [];
const NativeWebSocket = window.WebSocket;
window.WebSocket = function (url, protocols) {
  const socket = new NativeWebSocket(url, protocols);
  window.__sockets.push(socket);
  return socket;
};
window.WebSocket.prototype = NativeWebSocket.prototype;
"""


def test_the_live_socket_reconnects_after_a_drop_and_stops_once_refused(browser, live_server_asgi):
    server = live_server_asgi
    tenant = TenantFactory(slug="acme", name="Acme Corp")
    MembershipFactory(tenant=tenant, user=UserFactory(username="rae"), role="owner")
    page = log_in(browser, server, "rae")
    page.context.add_init_script(KEEP_SOCKETS)
    page.goto(server.url + "/t/acme/adapters/")
    page.wait_for_selector("body[data-live-connected=yes]")

    page.evaluate("window.__sockets.at(-1).close()")  # a drop: the page opens a new one
    page.wait_for_function("window.__sockets.length === 2 && document.body.dataset.liveConnected === 'yes'",
                           timeout=10_000)  # fmt: skip

    Membership.objects.filter(tenant=tenant, user__username="rae").delete()
    page.evaluate("window.__sockets.at(-1).close()")
    page.wait_for_selector("body[data-live-connected=refused]", timeout=10_000)
    page.wait_for_timeout(5_000)  # a client that retried a refusal would have opened two more sockets by now
    assert page.evaluate("window.__sockets.length") == 3
    assert "reload" in page.inner_text("[data-live-indicator]")
    page.context.close()
