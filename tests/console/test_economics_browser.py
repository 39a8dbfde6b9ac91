"""The Economics page in a real browser: staff see cost per token, an idle engine at 0% utilisation, and change the
break-even price and the capacity target through the page's forms."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from gateway.models import Engine
from registry.models import Adapter, AdapterVersion, BaseModel
from tests.console.test_browser import log_in
from tests.fleet.test_economics import BASE, _event
from tests.platform.factories import TenantFactory, UserFactory

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_staff_read_costs_and_plan_capacity(browser, live_server_asgi, screenshots):
    server = live_server_asgi
    UserFactory(username="ops-economics", is_staff=True)
    tenant = TenantFactory(slug="econ-web")
    base = BaseModel.objects.create(name=BASE, checkpoint_dir="/nowhere", architecture="llama", config={},
                                    max_context=256)
    version = AdapterVersion.objects.create(adapter=Adapter.objects.create(tenant=tenant, name="support",
                                                                           base_model=base), number=1, digest="e" * 64)
    Engine.objects.create(name="gpu-a", url="http://10.0.0.1:8100", gpu_price_per_hour=Decimal("3.6"))
    Engine.objects.create(name="gpu-idle", url="http://10.0.0.2:8100", gpu_price_per_hour=Decimal(2))
    finished = timezone.now() - timedelta(hours=1)
    for request_id, adapter in (("web-1", None), ("web-2", version)):
        event = _event(tenant, request_id, engine="gpu-a", prompt=500, cached=0, completion=500, gpu_ms=1_800_000,
                       price_per_hour=Decimal("3.6"), ttft_ms=20.0, version=adapter)
        event.finished_at = finished
        event.save(update_fields=["finished_at"])

    page = log_in(browser, server, "ops-economics")
    page.goto(server.url + "/platform/economics/")
    # $3.60 over 2,000 computed tokens: $1,800 per million, input and output alike (nothing cached)
    assert "$1800.0000" in page.locator("[data-testid=base-models]").inner_text()
    assert "econ-web/support@1" in page.locator("[data-testid=adapters]").inner_text()
    engines = page.locator("[data-testid=engines]").inner_text()
    assert "gpu-idle" in engines and "0%" in engines
    assert page.locator("svg.chart").is_visible()
    # A finished chart: both axes ticked (five money ticks up the side) and titled; the forms' inputs styled
    # like the rest of the console, inside their card with room around them.
    chart = page.locator("svg.break-even-chart")
    assert chart.locator("text.axis:not(.x):not(.axis-title)").count() == 5
    assert chart.locator("text.axis.x").count() == 5
    titles = chart.locator("text.axis-title").evaluate_all("nodes => nodes.map(node => node.textContent)")
    assert titles == ["$ a month", "Tokens a month"]
    page.locator(".card:has([data-testid=break-even-form])").screenshot(path=str(screenshots / "62-economics-break-even.png"))
    for form in ("break-even-form", "capacity-form"):
        card = page.locator(f".card:has([data-testid={form}])").bounding_box()
        for field in page.locator(f"[data-testid={form}] input:not([type=hidden])").all():
            box = field.bounding_box()
            assert box["x"] >= card["x"] + 12 and box["x"] + box["width"] <= card["x"] + card["width"] - 12, form
            assert field.evaluate("node => getComputedStyle(node).borderTopLeftRadius") != "0px", form

    page.fill("input[name=api_price]:not([type=hidden])", "0")
    page.locator("form:has(input[name=api_price]:not([type=hidden])) button").click()
    page.wait_for_url(lambda url: "api_price=0" in url)
    assert "never costs less" in page.locator("[data-testid=break-even]").inner_text()

    page.fill("input[name=target_rps]:not([type=hidden])", "1")
    page.fill("input[name=target_ttft_ms]:not([type=hidden])", "1000")
    page.locator("form:has(input[name=target_rps]:not([type=hidden])) button").click()
    page.wait_for_url(lambda url: "target_rps=1" in url)
    # 2 requests per 3,600 busy seconds, 20 ms idle TTFT: rho 0.98, ⌈1 / (2/3600 × 0.98)⌉ = 1837 engines; the
    # measured rate to three significant digits
    capacity = page.locator("[data-testid=capacity]").inner_text()
    assert "1,837 engines" in capacity and "(0.000556 requests per busy engine-second" in capacity, capacity
