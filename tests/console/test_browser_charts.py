"""Charts as a browser draws them: every axis label inside its chart (real Chromium, real fonts)."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from apikeys.services import api_key_create
from metering.services import usage_ingest
from tenancy.audit import Actor
from tenancy.models import Plan
from tests.console.builders import usage_event
from tests.console.test_browser import PASSWORD, log_in
from tests.platform.factories import MembershipFactory, TenantFactory, UserFactory

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# [label, left, right] of every axis label that spills out of its chart's viewBox (where the browser clips it).
CLIPPED_LABELS = """() => [...document.querySelectorAll('svg.chart')].flatMap(svg => {
  const width = svg.viewBox.baseVal.width;
  return [...svg.querySelectorAll('text.axis')].map(text => [text.textContent, text.getBBox().x, text.getBBox().x + text.getBBox().width])
    .filter(([, left, right]) => left < 0 || right > width);
})"""


@pytest.mark.parametrize("width", [1360, 390])
def test_every_axis_label_of_a_sub_cent_tenants_charts_is_drawn_whole(browser, live_server_asgi, width):
    plan = Plan.objects.create(slug="metered", name="Metered", price_input_per_mtok=Decimal("0.20"),
                               price_output_per_mtok=Decimal("0.60"))  # fmt: skip
    tenant = TenantFactory(slug="tiny", name="Tiny", plan=plan)
    MembershipFactory(tenant=tenant, user=UserFactory(username="tina", password=PASSWORD), role="owner")
    key, _ = api_key_create(actor=Actor.system(), tenant=tenant, name="backend", scopes=["inference"])
    now = timezone.now()
    usage_ingest(events=[usage_event(tenant, api_key=key, finished_at=now - timedelta(days=day), prompt_tokens=10 * day,
                                     cached_tokens=0, completion_tokens=7) for day in range(1, 4)])  # fmt: skip
    page = log_in(browser, live_server_asgi, "tina")
    page.set_viewport_size({"width": width, "height": 900})
    for path in ("/t/tiny/", "/t/tiny/usage/"):
        page.goto(live_server_asgi.url + path)
        assert page.locator("svg.chart").count() >= 1
        spend_ticks = page.locator("svg.chart text.axis", has_text="$0.0000")
        assert spend_ticks.count() >= 4, path  # sub-cent ticks: the long labels this is about
        assert page.evaluate(CLIPPED_LABELS) == [], path
    page.context.close()


# Per chart: the smallest axis font as drawn (px: its font size times the SVG's scale), and every axis label whose box overlaps the plotted data (bars,
# lines and dots), as [label, mark] pairs.
AXIS_SIZES_AND_OVERLAPS = """() => [...document.querySelectorAll('svg.chart')].map(svg => {
  const boxes = sel => [...svg.querySelectorAll(sel)].map(node => [node, node.getBoundingClientRect()]);
  const labels = boxes('text.axis').filter(([node]) => getComputedStyle(node).display !== 'none');
  const marks = boxes('rect.bar, rect.bar-2, circle.series-dot, circle.dot');
  const overlaps = [];
  for (const [label, a] of labels) for (const [mark, b] of marks) {
    if (b.width && b.height && a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom)
      overlaps.push([label.textContent, mark.getAttribute('class')]);
  }
  const box = svg.getBoundingClientRect();
  const scale = box.width / svg.viewBox.baseVal.width;
  const sizes = labels.map(([node]) => parseFloat(getComputedStyle(node).fontSize) * scale);
  return {smallest: Math.min(...sizes), overlaps, width: box.width, height: box.height};
})"""


def read_out_the_first_p50(page, point_at):
    """Points (hover or tap) at the percentiles chart's first p50 dot; returns its readout and the dot's box."""
    chart = page.locator("#percentiles-chart svg.chart")
    chart.scroll_into_view_if_needed()
    dot = chart.locator("circle.series-dot[data-series=p50]").first.bounding_box()
    point_at(dot["x"] + dot["width"] / 2, dot["y"] + dot["height"] / 2)
    readout = page.locator("#percentiles-chart .chart-readout")
    assert readout.is_visible() and "p50 250.0" in readout.inner_text(), readout.inner_text()
    return readout, dot


# [title, figures] boxes of the overview's token budget.
BUDGET_BOXES = """() => [...document.querySelectorAll('[data-testid=token-budget] > *')].map(node => {
  const box = node.getBoundingClientRect();
  return {left: box.left, right: box.right, top: box.top, bottom: box.bottom};
})"""


def test_charts_at_390_px_are_legible_distinguishable_and_read_out_on_tap(browser, live_server_asgi):
    plan = Plan.objects.create(slug="budgeted", name="Budgeted", monthly_token_budget=50_000_000)
    tenant = TenantFactory(slug="phone", name="Phone", plan=plan)
    MembershipFactory(tenant=tenant, user=UserFactory(username="pia", password=PASSWORD), role="owner")
    now = timezone.now().replace(minute=30, second=0, microsecond=0)
    # Two hours with requests 20 hours apart (lone points on an hourly axis, across midnight for the day labels);
    # every request takes the same time, so p50, p95 and p99 are equal series. Long adapter names fill the
    # adapter load legend.
    usage_ingest(events=[usage_event(tenant, finished_at=now - timedelta(hours=hours), e2e_ms=250.0,
                                     model=f"customer-support-summaries-{n}@12")
                         for hours in (1, 21) for n in range(3)])  # fmt: skip
    page = log_in(browser, live_server_asgi, "pia")
    page.set_viewport_size({"width": 390, "height": 844})
    # The budget's title and figures keep apart (side by side, or one above the other).
    title, figures = page.evaluate(BUDGET_BOXES)
    assert figures["left"] >= title["right"] + 8 or figures["top"] >= title["bottom"], (title, figures)
    page.goto(live_server_asgi.url + "/t/phone/usage/?every=hour")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    chart = page.locator("#percentiles-chart svg.chart")
    assert chart.count() == 1
    for measured in page.evaluate(AXIS_SIZES_AND_OVERLAPS):
        assert measured["smallest"] >= 12, measured
        assert measured["overlaps"] == [], measured
        assert measured["height"] >= 44 and measured["width"] >= 44  # the whole plot is the tap target
    # Equal series: each is drawn, with its own dash, and a lone hour shows as a dot.
    dashes = chart.evaluate("svg => [...svg.querySelectorAll('path.series-line')].map(p => getComputedStyle(p)"
                            ".strokeDasharray)")  # fmt: skip
    assert len(dashes) == 4 and len(set(dashes)) == 4, dashes
    assert chart.locator("circle.series-dot[data-series=p99]").count() == 2
    labels = chart.locator("text.axis.x").evaluate_all("nodes => nodes.map(node => node.textContent)")
    assert any(label[:3].isalpha() for label in labels) and any(":" in label for label in labels), labels
    # A desktop: the half-width charts too are drawn with text of 12 px or more, and hovering a bucket shows its
    # values in a tooltip beside it (not the browser's own title tooltip).
    page.set_viewport_size({"width": 1440, "height": 900})
    page.goto(live_server_asgi.url + "/t/phone/usage/?every=hour")
    for measured in page.evaluate(AXIS_SIZES_AND_OVERLAPS):
        assert measured["smallest"] >= 12, measured
        assert measured["overlaps"] == [], measured
    readout, dot = read_out_the_first_p50(page, page.mouse.move)
    box, card = readout.bounding_box(), page.locator("#percentiles-chart .card-body").bounding_box()
    assert box["x"] >= card["x"] and box["x"] + box["width"] <= card["x"] + card["width"] + 1
    assert min(abs(box["x"] - dot["x"]), abs(box["x"] + box["width"] - dot["x"])) < 40, (box, dot)
    assert page.locator("#percentiles-chart svg.chart title").count() == 0
    page.context.close()
    # On a touch screen, a tap reads the nearest hour out, and a tap anywhere else closes it.
    touch = browser.new_context(viewport={"width": 390, "height": 844}, has_touch=True)
    page = touch.new_page()
    page.goto(live_server_asgi.url + "/login/")
    page.fill("#id_username", "pia")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(lambda url: "/login/" not in url)
    page.goto(live_server_asgi.url + "/t/phone/usage/?every=hour")
    readout, _ = read_out_the_first_p50(page, page.touchscreen.tap)
    heading = page.locator("#percentiles-chart .card-head h2").bounding_box()
    page.touchscreen.tap(heading["x"] + 5, heading["y"] + heading["height"] / 2)
    assert readout.is_hidden()
    touch.close()
