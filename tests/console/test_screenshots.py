"""Screenshots of the main pages over a lived-in platform, saved under var/screenshots/ (CI artifacts).

Each page is also checked for what a person would look for on it, so a broken page fails here too.
"""

from datetime import timedelta

import pytest
from django.utils import timezone

from gateway.models import Engine
from metering.models import RequestBody, UsageEvent
from tests.console.scenery import build
from tests.platform.factories import UserFactory

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PASSWORD = "pw-12345-secret"

# WCAG contrast of each visible text element against the first opaque background behind it; returns the failures.
LOW_CONTRAST = """() => {
  const rgb = (text) => (text.match(/[\\d.]+/g) || []).map(Number);
  const lum = ([r, g, b]) => [r, g, b].map((c) => { c /= 255; return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; })
    .reduce((sum, c, i) => sum + c * [0.2126, 0.7152, 0.0722][i], 0);
  const background = (element) => {
    for (let node = element; node; node = node.parentElement) {
      const color = rgb(getComputedStyle(node).backgroundColor);
      if (color.length === 3 || (color.length === 4 && color[3] === 1)) return color.slice(0, 3);
      if (getComputedStyle(node).backgroundImage !== "none") return null;  // a gradient: not judged here
    }
    return [255, 255, 255];
  };
  const failures = [];
  for (const element of document.querySelectorAll("body *:not(svg *):not(script):not(style)")) {
    const own = Array.from(element.childNodes).some((n) => n.nodeType === 3 && n.textContent.trim());
    const style = getComputedStyle(element);
    if (!own || style.visibility === "hidden" || !element.getClientRects().length) continue;
    if (element.closest("[disabled], .sidebar, .skip-link, .auth-side, input, select, option")) continue;
    const fg = rgb(style.color), bg = background(element);
    if (!bg || (fg.length === 4 && fg[3] < 1)) continue;
    const [a, b] = [lum(fg), lum(bg)].sort((x, y) => y - x);
    const ratio = (a + 0.05) / (b + 0.05);
    if (ratio < 4.5) failures.push(`${element.tagName}.${element.className} "${element.textContent.trim().slice(0, 30)}" ${ratio.toFixed(2)}`);
  }
  return failures;
}"""


def log_in(page, server, username: str) -> None:
    page.goto(server.url + "/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(lambda url: "/login/" not in url)


def shoot(page, screenshots, name: str) -> None:
    page.wait_for_load_state("networkidle")
    page.screenshot(path=str(screenshots / f"{name}.png"), full_page=True)


def assert_phone_layout(page) -> None:
    """Content first (the sidebar is a closed drawer), nothing wider than the screen."""
    sidebar = page.locator("#sidebar").bounding_box()
    assert sidebar["x"] + sidebar["width"] <= 0, "the sidebar should be off screen until the menu opens it"
    assert page.locator("[data-testid=menu-button]").is_visible()
    assert page.locator("h1").first.bounding_box()["y"] < 200, "the page's heading comes first"
    assert page.evaluate("document.documentElement.scrollWidth") <= 390


# Every element that scrolls sideways (wider content than its box): a table pushed past its card, a long line.
SCROLLING_SIDEWAYS = """() => [document.documentElement, ...document.querySelectorAll('.card, .table-wrap, pre, dd')]
  .filter(node => node.scrollWidth > node.clientWidth + 1)
  .map(node => `${node.tagName}.${node.className} ${node.scrollWidth} > ${node.clientWidth}`)"""


# Each legend entry: [how many lines of text it takes, its top].
LEGEND_LINES = """spans => spans.map(span => {
  const style = getComputedStyle(span);
  const line = style.lineHeight === "normal" ? 1.25 * parseFloat(style.fontSize) : parseFloat(style.lineHeight);
  const box = span.getBoundingClientRect();
  return [box.height / line, Math.round(box.top)];
})"""


def assert_desktop_layouts(page, server, slug: str, request_id: str) -> None:
    """The keys' Rotate and Revoke on screen at 1280, 1440 and 1920 px; at 1440 a one-line prompt wrapped in the
    request's page and the percentile legend on one line; no page scrolling sideways."""
    for width in (1280, 1920, 1440):
        page.set_viewport_size({"width": width, "height": 900})
        page.goto(f"{server.url}/t/{slug}/keys/")
        buttons = page.locator("#keys-table td.actions-cell button")
        assert buttons.count() >= 2
        for index in range(buttons.count()):
            box = buttons.nth(index).bounding_box()
            assert box["x"] >= 0 and box["x"] + box["width"] <= width, (width, buttons.nth(index).inner_text(), box)
        assert page.evaluate(SCROLLING_SIDEWAYS) == [], width
    page.goto(f"{server.url}/t/{slug}/requests/{request_id}/")
    assert page.locator("[data-testid=request-prompt]").is_visible()
    assert page.evaluate(SCROLLING_SIDEWAYS) == []
    page.goto(f"{server.url}/t/{slug}/usage/")
    legend = page.locator("#percentiles-chart .legend span").evaluate_all(LEGEND_LINES)
    assert all(lines < 1.5 for lines, _ in legend) and len({top for _, top in legend}) == 1, legend


def test_screenshots_of_the_main_pages(browser, live_server_asgi, screenshots, adapter_zips, base_model, settings):
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
    page.goto(f"{server.url}/t/{slug}/usage/?every=hour")
    assert page.locator("#requests-chart svg[data-bucket=hour]").count() == 1
    assert page.locator("#load-chart [data-series=support-bot]").count() == 1
    shoot(page, screenshots, "30-usage-hourly")
    page.goto(f"{server.url}/t/{slug}/billing/")
    assert page.locator("#preview-lines tbody tr").count() >= 1
    page.goto(f"{server.url}/t/{slug}/billing/")
    page.click("#invoices-table tbody a.primary")
    assert page.locator("#invoice-lines tbody tr").count() >= 2
    shoot(page, screenshots, "11-invoice")
    for path in ["", "keys/", "usage/", "adapters/", "billing/", "members/"]:
        page.goto(f"{server.url}/t/{slug}/{path}")
        assert page.evaluate(LOW_CONTRAST) == [], path

    # A keyboard user's first Tab reaches the skip link, which moves focus to the content.
    page.goto(f"{server.url}/t/{slug}/keys/")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Skip to content"
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.id") == "content"

    logged = UsageEvent.objects.filter(tenant=world["tenant"]).first()
    RequestBody.objects.create(tenant=world["tenant"], request_id=logged.request_id, expires_at=timezone.now() +
                               timedelta(days=1), prompt=[{"role": "user", "content": "word " * 900}],
                               completion="x" * 3000)  # fmt: skip
    assert_desktop_layouts(page, server, slug, logged.request_id)
    context.close()

    phone = browser.new_context(viewport={"width": 390, "height": 844}, device_scale_factor=2, is_mobile=True,
                                has_touch=True)  # fmt: skip
    page = phone.new_page()
    log_in(page, server, "dana")
    page.goto(f"{server.url}/t/{slug}/")
    shoot(page, screenshots, "21-phone-overview")
    assert_phone_layout(page)
    axis = page.locator(".chart text.axis").first.bounding_box()
    assert axis["height"] >= 9, f"chart text {axis['height']:.1f} px tall on a phone"
    page.click("[data-testid=menu-button]")
    page.wait_for_function("document.querySelector('#sidebar').getBoundingClientRect().left >= 0")
    shoot(page, screenshots, "27-phone-menu-open")
    page.click("#sidebar >> text=API keys")
    page.wait_for_url("**/keys/")
    assert_phone_layout(page)
    revoke = page.locator("#keys-table tbody tr button:has-text('Revoke')").first
    box = revoke.bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 390, box
    assert page.locator("#keys-table tbody tr td[data-label=Status]").count() >= 1
    shoot(page, screenshots, "28-phone-keys")
    page.goto(f"{server.url}/t/{slug}/usage/")
    assert_phone_layout(page)
    shoot(page, screenshots, "29-phone-usage")
    phone.close()

    context = browser.new_context(viewport={"width": 1440, "height": 900})
    page = context.new_page()
    log_in(page, server, "ops")
    for name, path in [("13-platform", "/platform/"), ("14-tenants", "/platform/tenants/"),
                       ("15-tenant-detail", f"/platform/tenants/{slug}/"), ("17-plans", "/platform/plans/")]:  # fmt: skip
        page.goto(server.url + path)
        shoot(page, screenshots, name)
        overflowing = page.evaluate(
            "Array.from(document.querySelectorAll('.card')).filter(c => c.scrollWidth > c.clientWidth + 1).length"
        )
        assert overflowing == 0 and page.evaluate("document.documentElement.scrollWidth") <= 1440, path
        assert page.evaluate(LOW_CONTRAST) == [], path
    page.goto(server.url + "/platform/invoicing/")
    shoot(page, screenshots, "31-invoicing")
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
    page.evaluate("window.__sameDocument = true")
    # As the health check records state, from a process whose channel layer is not the server's (this one has
    # none, like the demo's worker): the push goes through the server's relay, at once, not polled.
    settings.QUILT_LIVE_RELAY_URL = server.url + "/internal/live-relay/"
    engine.state = {**engine.state, "running": 21}
    engine.save(update_fields=["state"])
    page.wait_for_selector("[data-engine=gpu-a] [data-testid=running]:text-is('21')", timeout=5_000)
    assert page.evaluate("window.__sameDocument") is True
    context.close()
