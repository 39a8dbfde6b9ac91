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
