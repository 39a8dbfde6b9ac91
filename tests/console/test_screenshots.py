"""Screenshots of the main pages over a lived-in platform, saved under var/screenshots/ (CI artifacts).

Each page is also checked for what a person would look for on it, so a broken page fails here too.
"""

import pytest

from gateway.models import Engine
from tests.console.scenery import build
from tests.platform.factories import UserFactory

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PASSWORD = "pw-12345-secret"


def log_in(page, server, username: str) -> None:
    page.goto(server.url + "/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(lambda url: "/login/" not in url)


def shoot(page, screenshots, name: str) -> None:
    page.wait_for_load_state("networkidle")
    page.screenshot(path=str(screenshots / f"{name}.png"), full_page=True)


def test_screenshots_of_the_main_pages(browser, live_server_asgi, screenshots, adapter_zips, base_model):
    staff = UserFactory(username="ops", is_staff=True, first_name="Olivia")
    world = build(zips=adapter_zips, staff=staff)
    server, slug = live_server_asgi, world["tenant"].slug

    context = browser.new_context(viewport={"width": 1440, "height": 900})
    page = context.new_page()
    page.goto(server.url + "/login/")
    shoot(page, screenshots, "01-login")

    log_in(page, server, "dana")
    page.goto(f"{server.url}/t/{slug}/")
    assert page.locator("[data-testid=budget-meter]").count() == 1
    assert int(page.locator(".chart").get_attribute("data-total-tokens")) > 0
    shoot(page, screenshots, "02-overview")

    page.goto(f"{server.url}/t/{slug}/adapters/")
    assert page.locator("#adapters-table tbody tr").count() == 2
    shoot(page, screenshots, "03-adapters")
    page.click("text=support-bot")
    assert page.inner_text("[data-testid=current-version]") == "v2"
    shoot(page, screenshots, "04-adapter-detail")
    page.goto(f"{server.url}/t/{slug}/adapters/upload/")
    shoot(page, screenshots, "05-adapter-upload")

    page.goto(f"{server.url}/t/{slug}/keys/")
    page.click("[data-testid=create-key]")
    page.fill("#id_name", "analytics")
    page.click("[data-testid=create-key-submit]")
    assert page.inner_text("[data-testid=key-secret]").count(".") == 1
    shoot(page, screenshots, "06-key-created")
    page.goto(f"{server.url}/t/{slug}/keys/")
    shoot(page, screenshots, "07-keys")

    for name, path in [("08-members", "members/"), ("09-usage", "usage/"), ("10-billing", "billing/"),
                       ("12-audit", "audit/")]:  # fmt: skip
        page.goto(f"{server.url}/t/{slug}/{path}")
        shoot(page, screenshots, name)
    page.goto(f"{server.url}/t/{slug}/billing/")
    page.click("#invoices-table tbody a.primary")
    assert page.locator("#invoice-lines tbody tr").count() >= 2
    shoot(page, screenshots, "11-invoice")
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{server.url}/t/{slug}/")
    shoot(page, screenshots, "21-phone-overview")
    context.close()

    context = browser.new_context(viewport={"width": 1440, "height": 900})
    page = context.new_page()
    log_in(page, server, "ops")
    for name, path in [("13-platform", "/platform/"), ("14-tenants", "/platform/tenants/"),
                       ("15-tenant-detail", f"/platform/tenants/{slug}/"), ("17-plans", "/platform/plans/")]:  # fmt: skip
        page.goto(server.url + path)
        shoot(page, screenshots, name)
    page.goto(server.url + "/platform/plans/scale/")
    shoot(page, screenshots, "18-plan-edit")
    page.goto(f"{server.url}/t/{slug}/adapters/sql-writer/")
    assert page.locator("[data-testid=failure-message]").count() == 1
    shoot(page, screenshots, "19-adapter-failed-version")
    page.goto(server.url + "/platform/engines/")
    page.wait_for_selector("body[data-live-connected=yes]")
    assert page.locator("[data-engine=gpu-a] [data-testid=running]").inner_text() == "14"
    shoot(page, screenshots, "16-engines")
    engine = Engine.objects.get(name="gpu-a")
    Engine.objects.filter(pk=engine.pk).update(state={**engine.state, "running": 21})
    page.evaluate("window.__sameDocument = true")
    page.wait_for_selector("[data-engine=gpu-a] [data-testid=running]:text-is('21')", timeout=20_000)
    assert page.evaluate("window.__sameDocument") is True
    context.close()
