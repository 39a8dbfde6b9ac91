"""Usage and billing pages: filters, chart, CSV, invoices; pages read the daily roll-ups, not every event."""

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import freezegun
import pytest
from django.urls import reverse
from django.utils import timezone

from apikeys.services import api_key_create
from billing.invoices import invoice_issue, previous_month
from metering.models import UsageEvent
from metering.rollups import OVERLAP, usage_rollup_recent
from metering.services import usage_ingest
from tenancy.audit import Actor
from tests.console.builders import usage_event

pytestmark = pytest.mark.django_db


def url(name: str, tenant, query: str = "") -> str:
    return reverse(f"console:{name}", kwargs={"slug": tenant.slug}) + query


@pytest.fixture
def usage(tenant, other_tenant):
    """Two keys, two models, ten days; plus another tenant's usage that must never show."""
    now = timezone.now()
    key_a, _ = api_key_create(actor=Actor.system(), tenant=tenant, name="backend", scopes=["inference"])
    key_b, _ = api_key_create(actor=Actor.system(), tenant=tenant, name="batch", scopes=["inference"])
    events = []
    for day in range(10):
        at = now - timedelta(days=day, minutes=5)
        events.append(usage_event(tenant, model="support-bot", api_key=key_a, finished_at=at,
                                  prompt_tokens=1000, cached_tokens=100, completion_tokens=200))  # fmt: skip
        events.append(usage_event(tenant, model="tiny-llama", api_key=key_b, finished_at=at,
                                  prompt_tokens=500, cached_tokens=0, completion_tokens=50))  # fmt: skip
        events.append(usage_event(other_tenant, finished_at=at, prompt_tokens=99_999, completion_tokens=1))
    usage_ingest(events=events)
    return {"keys": (key_a, key_b), "now": now}


def test_usage_page_filters_by_model_and_key(tenant, member_of, usage):
    client, _ = member_of(tenant, "viewer")
    everything = client.get(url("usage", tenant))
    assert everything.context["total"].requests == 20
    assert 'data-total-tokens="17500"' in everything.content.decode()
    by_model = client.get(url("usage", tenant, "?model=support-bot&group=model")).context
    assert [(row.group, row.requests, row.total_tokens) for row in by_model["table"].rows] == [("support-bot", 10, 12000)]
    key_b = usage["keys"][1]
    by_key = client.get(url("usage", tenant, f"?key={key_b.prefix}")).context
    assert by_key["total"].requests == 10 and by_key["total"].total_tokens == 5500
    since = (usage["now"] - timedelta(days=2)).date().isoformat()
    recent = client.get(url("usage", tenant, f"?since={since}")).context
    assert recent["total"].requests == 6


def test_usage_csv_matches_the_table(tenant, member_of, usage):
    client, _ = member_of(tenant, "viewer")
    response = client.get(url("usage-csv", tenant, "?group=key"))
    assert response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    by_prefix = {row["key"]: row for row in rows}
    key_a, key_b = usage["keys"]
    assert by_prefix[key_a.prefix]["requests"] == "10" and by_prefix[key_a.prefix]["total_tokens"] == "12000"
    assert by_prefix[key_b.prefix]["prompt_tokens"] == "5000"
    assert set(by_prefix) == {key_a.prefix, key_b.prefix}


@pytest.fixture(params=["12:00", "00:05"], ids=["midday", "just-after-midnight"])
def clock(request):
    """The wall clock at a set time of day (UTC), running."""
    with freezegun.freeze_time(f"2026-03-10T{request.param}:00+00:00", tick=True):
        yield


def test_pages_read_the_daily_rollups_not_the_raw_events(clock, tenant, member_of, usage,
                                                         django_assert_max_num_queries):
    """After a roll-up, days before it come from UsageDaily: deleting their raw events changes nothing shown,
    and the query count does not depend on how many events there were. The roll-up is a day after the newest
    event, beyond its overlap with raw events, whatever the time of day."""
    client, _ = member_of(tenant, "owner")
    usage_rollup_recent(now=usage["now"] + timedelta(days=1) + OVERLAP)
    UsageEvent.objects.filter(tenant=tenant).delete()
    with django_assert_max_num_queries(21):
        page = client.get(url("usage", tenant, "?group=model"))
    assert page.context["total"].requests == 20
    assert {row.group: row.requests for row in page.context["table"].rows} == {"support-bot": 10, "tiny-llama": 10}
    with django_assert_max_num_queries(20):
        overview = client.get(url("tenant-overview", tenant))
    assert 'data-total-tokens="17500"' in overview.content.decode()


def test_the_overview_budget_bar_turns_amber_then_red(tenant, member_of):
    client, _ = member_of(tenant, "viewer")
    plan = tenant.plan
    plan.price_output_per_mtok, plan.monthly_spend_limit = 1000, 10
    plan.save()
    now = timezone.now()
    usage_ingest(events=[usage_event(tenant, finished_at=now, prompt_tokens=0, cached_tokens=0, completion_tokens=8500)])
    page = client.get(url("tenant-overview", tenant)).content.decode()
    assert 'class="meter amber" data-testid="budget-meter" data-percent="85"' in page
    usage_ingest(events=[usage_event(tenant, finished_at=now, prompt_tokens=0, cached_tokens=0, completion_tokens=2000)])
    page = client.get(url("tenant-overview", tenant)).content.decode()
    assert 'class="meter red" data-testid="budget-meter" data-percent="105"' in page


def test_invoices_list_detail_and_csv(tenant, member_of):
    client, _ = member_of(tenant, "admin")
    plan = tenant.plan
    plan.price_input_per_mtok, plan.price_output_per_mtok = 2, 4
    plan.save()
    month = previous_month(timezone.now().date())
    at = datetime.combine(month, datetime.min.time(), tzinfo=UTC) + timedelta(days=3)
    usage_ingest(events=[usage_event(tenant, finished_at=at, prompt_tokens=1_000_000, cached_tokens=0,
                                     completion_tokens=250_000)])  # fmt: skip
    invoice = invoice_issue(tenant=tenant, month=month)
    listing = client.get(url("billing", tenant))
    assert [row.number for row in listing.context["invoices"].rows] == [invoice.number]
    detail = client.get(reverse("console:invoice", kwargs={"slug": tenant.slug, "invoice_id": invoice.pk}))
    assert b"$3.00" in detail.content
    rows = list(csv.reader(io.StringIO(client.get(
        reverse("console:invoice-csv", kwargs={"slug": tenant.slug, "invoice_id": invoice.pk})).content.decode())))
    assert rows[1][2:4] == ["tiny-llama", "tiny-llama"] and rows[-1][-1] == "3.00"


def test_invoices_of_another_tenant_are_not_found(tenant, other_tenant, member_of):
    client, _ = member_of(tenant, "owner")
    invoice = invoice_issue(tenant=other_tenant, month=previous_month(timezone.now().date()))
    for name in ("invoice", "invoice-csv"):
        mine = reverse(f"console:{name}", kwargs={"slug": tenant.slug, "invoice_id": invoice.pk})
        assert client.get(mine).status_code == 404


def test_requests_errors_latency_and_load_per_hour_and_per_day(tenant, other_tenant, member_of):
    """Two hours of a day: one with a good request and an error, one with a faster request; another tenant's
    traffic never counts."""
    from metering.selectors import usage_buckets, usage_requests_by_model

    client, _ = member_of(tenant, "viewer")
    hour = (timezone.now() - timedelta(hours=3)).replace(minute=10, second=0, microsecond=0)
    usage_ingest(events=[
        usage_event(tenant, model="support-bot", finished_at=hour, completion_tokens=300, ttft_ms=100.0, e2e_ms=3100.0),
        usage_event(tenant, model="support-bot", finished_at=hour + timedelta(minutes=5), completion_tokens=0,
                    ttft_ms=None, e2e_ms=5.0, finish_reason="error"),
        usage_event(tenant, model="tiny-llama", finished_at=hour + timedelta(hours=1), completion_tokens=200,
                    ttft_ms=40.0, e2e_ms=1040.0),
        usage_event(other_tenant, finished_at=hour, finish_reason="error"),
    ])  # fmt: skip
    start = hour.replace(minute=0)
    hourly = usage_buckets(tenant=tenant, since=start, until=start + timedelta(hours=2), bucket="hour")
    assert [(b.requests, b.errors) for b in hourly] == [(2, 1), (1, 0)]
    assert hourly[0].ttft_ms == 100.0 and hourly[0].tokens_per_second == pytest.approx(100.0)  # 300 tokens in 3 s
    assert hourly[1].tokens_per_second == pytest.approx(200.0)
    load = usage_requests_by_model(tenant=tenant, since=start, until=start + timedelta(hours=2), bucket="hour")
    assert load == {"support-bot": {start: 2}, "tiny-llama": {start + timedelta(hours=1): 1}}

    page = client.get(url("usage", tenant, "?every=hour"))
    assert page.context["errors"] == 1
    body = page.content.decode()
    assert 'data-bucket="hour"' in body and 'data-series="Output tokens/s"' in body and 'data-series="support-bot"' in body
    daily = client.get(url("usage", tenant)).content.decode()
    assert 'data-bucket="day"' in daily and 'aria-current="true" data-testid="every-day"' in daily


@pytest.mark.parametrize("query", ["?since=9999-12-31", "?until=9999-12-31", "?until=0001-01-01", "?since=0001-01-01"])
def test_a_date_at_the_ends_of_the_calendar_is_refused_with_a_message_not_a_server_error(
    tenant, member_of, usage, query
):
    client, _ = member_of(tenant, "viewer")
    page = client.get(url("usage", tenant, query + "&model=support-bot"))
    assert page.status_code == 200
    assert "Choose a date between 1970-01-01 and 9998-12-31." in page.content.decode()
    assert page.context["filters"]["model"] == "support-bot"  # one bad field leaves the other filters as chosen
    assert page.context["total"].requests == 10
    csv = client.get(url("usage-csv", tenant, query))  # a download says what is wrong: a 400, in JSON
    assert csv.status_code == 400 and "1970-01-01" in csv.json()["error"]["message"]


def test_prices_show_every_decimal_the_plan_charges(tenant, member_of):
    plan = tenant.plan
    plan.price_input_per_mtok, plan.price_cached_input_per_mtok = Decimal("0.000125"), Decimal("0.00004")
    plan.price_output_per_mtok = Decimal("0.0375")
    plan.save()
    client, _ = member_of(tenant, "admin")
    page = client.get(url("billing", tenant)).content.decode()
    for text in ("<strong>$0.000125</strong>", "<strong>$0.00004</strong>", "<strong>$0.0375</strong>"):
        assert text in page


def test_overview_usage_and_billing_count_served_and_refused_requests_alike(tenant, member_of):
    """Three served requests and four refusals (three of them rate limits) this month: every page shows both."""
    from metering.gateway_reports import gateway_reports_record

    client, _ = member_of(tenant, "owner")
    now = timezone.now()
    usage_ingest(events=[usage_event(tenant, finished_at=now - timedelta(minutes=minute)) for minute in range(3)])
    refusals = [
        {"kind": "refused", "request_id": f"refused-{n}", "tenant_id": tenant.pk, "status_code": status,
         "error_code": "rate_limit_exceeded" if status == 429 else "model_not_found", "model": "tiny-llama",
         "finished_at": (now - timedelta(minutes=n)).isoformat()}
        for n, status in enumerate([429, 429, 429, 404])
    ]  # fmt: skip
    gateway_reports_record(reports=refusals)
    for name in ("tenant-overview", "usage", "billing"):
        page = client.get(url(name, tenant)).content.decode()
        assert 'data-served="3" data-refused="4"' in page, name
        assert "3 served · 4 refused (3 rate-limited)</span>" in page, name
    billing = client.get(url("billing", tenant)).content.decode()
    assert "tokens (<span" in billing and "</span>; refusals are not billed" in billing  # no stray spaces
    overview = client.get(url("tenant-overview", tenant)).content.decode()
    assert '<div class="value" data-testid="requests">7</div>' in overview


def test_input_means_every_prompt_token_on_usage_its_csv_and_billing(tenant, member_of):
    """1,200 prompt tokens, 200 of them from the prefix cache: Input reads 1,200 everywhere, cached 200."""
    client, _ = member_of(tenant, "owner")
    usage_ingest(events=[usage_event(tenant, finished_at=timezone.now(), prompt_tokens=1200, cached_tokens=200)])
    usage = client.get(url("usage", tenant)).context["table"].rows[0]
    assert (usage.prompt_tokens, usage.cached_tokens) == (1200, 200)
    rows = list(csv.DictReader(io.StringIO(client.get(url("usage-csv", tenant)).content.decode())))
    assert (rows[0]["prompt_tokens"], rows[0]["cached_tokens"]) == ("1200", "200")
    billing = client.get(url("billing", tenant)).content.decode()
    line = billing[billing.index('id="preview-lines"'):]
    assert '<td class="right">1,200</td><td class="right">200</td>' in line


def test_billing_says_how_usage_so_far_becomes_the_amount_due(tenant, member_of):
    """$0.0023 of usage is $0.00 due once the month's total is rounded to the cent: the page says both, and why."""
    plan = tenant.plan
    plan.price_input_per_mtok, plan.price_cached_input_per_mtok, plan.price_output_per_mtok = 1, 1, 1
    plan.save()
    client, _ = member_of(tenant, "admin")
    usage_ingest(events=[usage_event(tenant, finished_at=timezone.now(), prompt_tokens=2300, cached_tokens=0,
                                     completion_tokens=0)])  # fmt: skip
    page = client.get(url("billing", tenant)).content.decode()
    assert "$0.0023 of usage so far this month" in page
    assert "rounds the month's total to the cent, once: " in page and '"month-to-date-due">$0.00 due' in page
    assert 'data-testid="preview-usage">usage $0.0023, rounded to the cent' in page
