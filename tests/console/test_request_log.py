"""The request log: a tenant sees its own requests (staff every tenant's), filters narrow them, every sort pages by
cursor without repeating or skipping a row, a row opens its detail, and the CSV holds the same rows."""

import csv
import io
from datetime import UTC, datetime, timedelta

import pytest
from django.urls import reverse

from apikeys.services import api_key_create
from metering.models import UsageEvent
from metering.services import usage_ingest
from tenancy.audit import Actor
from tests.console.builders import usage_event

pytestmark = pytest.mark.django_db
START = datetime(2026, 11, 2, 9, 0, tzinfo=UTC)


@pytest.fixture
def logged(tenant, other_tenant):
    key, _ = api_key_create(actor=Actor.system(), tenant=tenant, name="backend", scopes=["inference"])
    events = [
        usage_event(tenant, api_key=key if number % 2 else None, finished_at=START + timedelta(minutes=number),
                    completion_tokens=10 + number, e2e_ms=float(100 + (number * 37) % 50),
                    finish_reason="error" if number == 7 else "stop")
        for number in range(30)
    ]  # fmt: skip
    usage_ingest(events=events + [usage_event(other_tenant, finished_at=START)])
    return key


def _url(tenant, **query) -> str:
    from urllib.parse import urlencode

    return reverse("console:requests", kwargs={"slug": tenant.slug}) + ("?" + urlencode(query) if query else "")


def _walk(client, url) -> list[str]:
    """Every request id, following the pages' cursors."""
    seen = []
    while url:
        page = client.get(url)
        assert page.status_code == 200
        seen += [row.request_id for row in page.context["page"].rows]
        url = page.context["next_url"] and url.split("?")[0] + page.context["next_url"]
    return seen


@pytest.mark.parametrize("sort", ["-time", "time", "-latency", "latency", "-cost", "tokens"])
def test_every_sort_pages_by_cursor_through_each_row_once(tenant, member_of, logged, sort, monkeypatch):
    monkeypatch.setattr("console.views.requests.PAGE_ROWS", 7)
    client, _ = member_of(tenant, "viewer")
    ids = _walk(client, _url(tenant, sort=sort))
    assert len(ids) == len(set(ids)) == 30  # the other tenant's request is not here


def test_newest_first_with_filters_and_detail(tenant, member_of, logged):
    client, _ = member_of(tenant, "viewer")
    page = client.get(_url(tenant))
    rows = page.context["page"].rows
    assert [row.finished_at for row in rows] == sorted((row.finished_at for row in rows), reverse=True)
    assert len(client.get(_url(tenant, key=logged.prefix)).context["page"].rows) == 15
    errors = client.get(_url(tenant, status="error")).context["page"].rows
    assert len(errors) == 1 and errors[0].status == "error"
    assert client.get(_url(tenant, since="2026-11-03")).context["page"].rows == []
    detail = client.get(reverse("console:request", kwargs={"slug": tenant.slug, "request_id": errors[0].request_id}))
    text = detail.content.decode()
    assert detail.status_code == 200 and 'data-testid="request-error"' in text and "Time to first token" in text
    assert "Shown to developers, admins and owners only." in text  # a viewer never reads prompts


def test_another_tenants_request_is_404_and_staff_sees_every_tenant(tenant, other_tenant, member_of, staff_client,
                                                                    logged):  # fmt: skip
    client, _ = member_of(tenant, "viewer")
    foreign = staff_client.get(reverse("console:platform-requests") + "?tenant=globex").context["page"].rows
    assert len(foreign) == 1
    url = reverse("console:request", kwargs={"slug": tenant.slug, "request_id": foreign[0].request_id})
    assert client.get(url).status_code == 404
    assert len(_walk(staff_client, reverse("console:platform-requests"))) == 31


def test_the_csv_holds_the_filtered_rows_and_a_bad_cursor_is_a_400(tenant, member_of, logged):
    client, _ = member_of(tenant, "viewer")
    response = client.get(reverse("console:requests-csv", kwargs={"slug": tenant.slug}) + f"?key={logged.prefix}")
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert len(rows) == 15 and {row["api_key"] for row in rows} == {logged.prefix}
    assert rows[0]["status"] in ("ok", "error") and rows[0]["e2e_ms"]
    assert client.get(_url(tenant, cursor="not-a-cursor")).status_code == 400


def test_the_api_lists_pages_and_shows_requests(tenant, logged):
    from tests.platform.conftest import client_for_key
    from tests.platform.factories import make_key

    api = client_for_key(make_key(tenant, scopes=("usage:read",))[1])
    first = api.get("/api/v1/requests?limit=20&sort=-time").json()
    assert len(first["data"]) == 20 and first["next_cursor"]
    rest = api.get(f"/api/v1/requests?limit=20&cursor={first['next_cursor']}").json()
    assert len(rest["data"]) == 10 and rest["next_cursor"] is None
    row = first["data"][0]
    assert {"request_id", "api_key", "adapter_version", "status", "ttft_ms", "e2e_ms", "cost", "error"} <= set(row)
    assert api.get(f"/api/v1/requests/{row['request_id']}").json()["request_id"] == row["request_id"]
    refused = api.get("/api/v1/requests?cursor=garbage")  # a cursor the list never gave out: 404, as DRF's own
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "invalid_cursor"  # cursor pages answer
    assert api.get("/api/v1/requests?status=nope").status_code == 400
    csv_rows = _streamed(api.get(f"/api/v1/requests.csv?key={logged.prefix}")).splitlines()
    assert len(csv_rows) == 16 and csv_rows[0].startswith("request_id,")


def _streamed(response) -> str:
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    return b"".join(response.streaming_content).decode()


def test_both_csvs_hold_every_matching_row_in_one_column_set_and_until_names_a_whole_day(tenant, member_of, logged):
    from tests.platform.conftest import client_for_key
    from tests.platform.factories import make_key

    usage_ingest(events=[usage_event(tenant, finished_at=START + timedelta(days=1, seconds=n)) for n in range(127)])
    api = client_for_key(make_key(tenant, scopes=("usage:read",))[1])
    console, _ = member_of(tenant, "viewer")
    console_csv = reverse("console:requests-csv", kwargs={"slug": tenant.slug})
    api_rows = list(csv.DictReader(io.StringIO(_streamed(api.get("/api/v1/requests.csv?limit=50")))))
    console_rows = list(csv.DictReader(io.StringIO(_streamed(console.get(console_csv)))))
    assert len(api_rows) == len(console_rows) == 157  # every row, not the first page's 50
    assert list(api_rows[0]) == list(console_rows[0]) and api_rows == console_rows
    assert {"status_code", "error_code", "engine_ttft_ms", "engine_e2e_ms"} <= set(api_rows[0])

    # until=2026-11-02 takes all of Nov 2 (the 30 requests from 09:00) and nothing of Nov 3, in every door
    day = START.date().isoformat()
    assert len(api.get(f"/api/v1/requests?until={day}&limit=200").json()["data"]) == 30
    assert len(api.get(f"/api/v1/requests?since={day}&until={day}&limit=200").json()["data"]) == 30
    assert len(list(csv.DictReader(io.StringIO(_streamed(api.get(f"/api/v1/requests.csv?until={day}")))))) == 30
    assert len(list(csv.DictReader(io.StringIO(_streamed(console.get(f"{console_csv}?until={day}")))))) == 30
    assert len(_walk(console, _url(tenant, until=day))) == 30
    instant = (START + timedelta(minutes=10)).isoformat()  # an instant is exclusive
    assert len(api.get("/api/v1/requests", {"until": instant, "limit": 200}).json()["data"]) == 10
    # the console takes what the API takes: an API query's instant pasted into the console's CSV was a 400
    assert len(list(csv.DictReader(io.StringIO(_streamed(console.get(console_csv, {"until": instant})))))) == 10
    assert len(_walk(console, _url(tenant, since=instant, until=day))) == 20


def test_retention_off_deletes_kept_bodies_at_once_and_viewers_never_read_them(tenant, member_of, staff_client,
                                                                               logged):  # fmt: skip
    from metering.models import RequestBody
    from metering.services import request_body_store

    admin, _ = member_of(tenant, "admin")
    viewer, _ = member_of(tenant, "viewer")
    settings_url = reverse("console:settings", kwargs={"slug": tenant.slug})
    form = {"billing_email": "", "webhook_url": "", "request_body_retention_days": "30"}
    assert admin.post(settings_url, form).status_code == 302
    event = admin.get(_url(tenant)).context["page"].rows[0]
    request_body_store(tenant_id=tenant.pk, request_id=event.request_id, prompt=[{"role": "user", "content": "hi"}],
                       completion="secret answer", retention_days=30)  # fmt: skip
    detail = reverse("console:request", kwargs={"slug": tenant.slug, "request_id": event.request_id})
    assert "secret answer" in admin.get(detail).content.decode()
    assert "secret answer" not in viewer.get(detail).content.decode()
    staff_detail = staff_client.get(reverse("console:platform-request", kwargs={"request_id": event.request_id}))
    assert "secret answer" in staff_detail.content.decode()
    staff_list = staff_client.get(reverse("console:platform-requests")).content.decode()
    assert "Metadata only" not in staff_list and "metadata only" not in staff_list

    assert admin.post(settings_url, form | {"request_body_retention_days": "7"}).status_code == 302
    assert RequestBody.objects.get().expires_at <= RequestBody.objects.get().created_at + timedelta(days=7)
    assert admin.post(settings_url, form | {"request_body_retention_days": "0"}).status_code == 302
    assert not RequestBody.objects.exists()  # at once, not at the old expiry
    assert "secret answer" not in admin.get(detail).content.decode()


def test_bodies_are_kept_only_where_the_tenant_opted_in_and_purged_after_retention(tenant, member_of, logged):
    from django.utils import timezone

    from metering.models import RequestBody
    from metering.services import request_body_store
    from metering.tasks import purge_request_bodies

    client, _ = member_of(tenant, "admin")
    event = client.get(_url(tenant)).context["page"].rows[0]
    request_body_store(tenant_id=tenant.pk, request_id=event.request_id, prompt=[{"role": "user", "content": "hi"}],
                       completion="hello", retention_days=0)  # fmt: skip
    assert not RequestBody.objects.exists()  # metadata only by default
    saved = client.post(reverse("console:settings", kwargs={"slug": tenant.slug}),
                        {"billing_email": "", "webhook_url": "", "request_body_retention_days": "7"})  # fmt: skip
    assert saved.status_code == 302
    tenant.refresh_from_db()
    assert tenant.request_body_retention_days == 7
    request_body_store(tenant_id=tenant.pk, request_id=event.request_id, prompt=[{"role": "user", "content": "hi"}],
                       completion="hello", retention_days=tenant.request_body_retention_days)  # fmt: skip
    detail = client.get(reverse("console:request", kwargs={"slug": tenant.slug, "request_id": event.request_id}))
    assert 'data-testid="request-completion">hello<' in detail.content.decode()
    assert purge_request_bodies() == 0
    RequestBody.objects.update(expires_at=timezone.now())
    assert purge_request_bodies() == 1 and not RequestBody.objects.exists()


def test_a_refusal_is_a_row_of_the_log_and_the_charts_but_never_usage(tenant, member_of, logged):
    from metering.gateway_reports import gateway_reports_record
    from metering.models import UsageEvent
    from metering.selectors import usage_buckets

    refusal = {"kind": "refused", "request_id": "refused-1", "tenant_id": tenant.pk, "api_key_id": logged.pk,
               "key_prefix": logged.prefix, "model": "support-bot", "base_model": "", "adapter_version_id": None,
               "status_code": 429, "error_code": "rate_limit_exceeded", "error": "Rate limit reached for requests.",
               "finished_at": (START + timedelta(minutes=45)).isoformat()}  # fmt: skip
    assert gateway_reports_record(reports=[refusal, refusal]).refusals == 2  # one row: the second is left as it is
    client, _ = member_of(tenant, "viewer")
    rows = client.get(_url(tenant, status="refused")).context["page"].rows
    assert [(row.request_id, row.status, row.status_code, row.api_key_prefix) for row in rows] == [
        ("refused-1", "refused", 429, logged.prefix)]
    detail = client.get(reverse("console:request", kwargs={"slug": tenant.slug, "request_id": "refused-1"}))
    assert "HTTP 429" in detail.content.decode() and "rate_limit_exceeded" in detail.content.decode()
    buckets = usage_buckets(tenant=tenant, since=START, until=START + timedelta(hours=1), bucket="hour")
    assert (buckets[0].requests, buckets[0].errors, buckets[0].refused) == (31, 2, 1)  # error #7 and the refusal
    assert not UsageEvent.objects.filter(request_id="refused-1").exists()  # what usage and billing count
    assert UsageEvent.answered.filter(request_id="refused-1").count() == 1

    timing = {"kind": "answered", "request_id": "console-req-missing", "status_code": 200, "ttft_ms": 5.0,
              "e2e_ms": 9.0}  # fmt: skip
    assert gateway_reports_record(reports=[timing]).unmatched == [timing]  # its engine's event is not here yet


def test_the_log_totals_every_matching_row_with_its_position_on_each_page(tenant, member_of, logged, monkeypatch):
    """30 requests (one failed) and a 429 refusal: the counts, tokens and cost are the filter's, not the page's."""
    from metering.gateway_reports import gateway_reports_record

    gateway_reports_record(reports=[{"kind": "refused", "request_id": "refused-1", "tenant_id": tenant.pk,
                                     "status_code": 429, "finished_at": START.isoformat()}])  # fmt: skip
    monkeypatch.setattr("console.views.requests.PAGE_ROWS", 20)
    client, _ = member_of(tenant, "viewer")
    first = client.get(_url(tenant))
    text = first.content.decode()
    assert "1–20 of 31</strong>" in text and "30 served · 1 refused (1 rate-limited)" in text
    completion = sum(10 + number for number in range(30))
    assert f'data-testid="log-tokens">36,000 / 6,000 / {completion:,}</span>' in text
    assert first.context["totals"].price == sum(row.price for row in UsageEvent.objects.filter(tenant=tenant))
    second = client.get(_url(tenant) + first.context["next_url"])
    assert "21–31 of 31</strong>" in second.content.decode()
    keyed = client.get(_url(tenant, key=logged.prefix)).content.decode()
    assert "1–15 of 15</strong>" in keyed


def test_a_request_costs_the_same_in_the_list_and_on_its_page_and_a_refusal_shows_the_plans_rates(tenant, member_of):
    from decimal import Decimal

    from metering.gateway_reports import gateway_reports_record

    plan = tenant.plan
    plan.price_input_per_mtok, plan.price_cached_input_per_mtok, plan.price_output_per_mtok = (
        Decimal("0.000125"), Decimal("0.00004"), Decimal("0.0375"))  # fmt: skip
    plan.save()
    usage_ingest(events=[usage_event(tenant, finished_at=START, prompt_tokens=10, cached_tokens=0,
                                     completion_tokens=155, request_id="tiny-cost")])  # fmt: skip
    gateway_reports_record(reports=[{"kind": "refused", "request_id": "refused-2", "tenant_id": tenant.pk,
                                     "status_code": 429, "base_model": "tiny-llama", "finished_at": START.isoformat()}])  # fmt: skip
    client, _ = member_of(tenant, "viewer")
    # 10 × 0.000125 + 155 × 0.0375 per million: $0.00000581375
    listed = client.get(_url(tenant)).content.decode()
    row = listed[listed.index('data-request="tiny-cost"'):]
    assert '<td class="right nowrap">$0.0000058</td>' in row[: row.index("</tr>")]
    detail = client.get(reverse("console:request", kwargs={"slug": tenant.slug, "request_id": "tiny-cost"}))
    assert '<span title="exactly $0.00000581375">$0.0000058</span>' in detail.content.decode()
    refused = client.get(reverse("console:request", kwargs={"slug": tenant.slug, "request_id": "refused-2"}))
    text = refused.content.decode()
    assert "Not charged: the gateway refused it." in text and "$0.00 / $0.00 / $0.00" not in text
    assert "The plan charges $0.000125 / $0.00004 / $0.0375 per 1M" in text


def test_an_anonymous_refusal_is_in_the_staffs_log_alone(tenant, member_of, staff_client, logged):
    """A request refused before a key let it in (a 401, a 413) has no tenant: staff see it, with the prefix of the
    key it presented, in the list, its page and the CSV; no tenant's log lists it."""
    from metering.gateway_reports import gateway_reports_record

    refusal = {"kind": "refused", "request_id": "anonymous-1", "tenant_id": None, "api_key_id": "",
               "key_prefix": "AbCd1234", "model": "", "base_model": "", "adapter_version_id": None, "status_code": 401,
               "error_code": "invalid_api_key", "error": "Incorrect API key provided.",
               "finished_at": datetime.now(UTC).isoformat()}  # fmt: skip
    assert gateway_reports_record(reports=[refusal]).refusals == 1
    rows = staff_client.get(reverse("console:platform-requests") + "?status=refused").context["page"].rows
    assert [(row.request_id, row.tenant_id, row.api_key_prefix) for row in rows] == [("anonymous-1", None, "AbCd1234")]
    detail = staff_client.get(reverse("console:platform-request", kwargs={"request_id": "anonymous-1"}))
    assert detail.status_code == 200 and b"refused before a key let it in" in detail.content
    assert b"Not charged: the gateway refused it." in detail.content and b"$0.00 / $0.00" not in detail.content
    exported = staff_client.get(reverse("console:platform-requests-csv"))
    assert "anonymous-1" in b"".join(exported.streaming_content).decode()
    client, _ = member_of(tenant, "viewer")
    assert "anonymous-1" not in _walk(client, _url(tenant))


def test_a_request_with_images_shows_their_count_and_tokens_in_the_list_its_page_the_csv_and_the_api(
        tenant, member_of, logged):  # fmt: skip
    event = usage_event(tenant, finished_at=START + timedelta(hours=1), image_count=2, image_tokens=640)
    usage_ingest(events=[event])
    client, _ = member_of(tenant, "viewer")
    listing = client.get(_url(tenant)).content.decode()
    assert listing.count('data-testid="log-images"') == 1 and "2 images, 640 tokens" in listing
    detail = client.get(reverse("console:request", kwargs={"slug": tenant.slug, "request_id": event["request_id"]}))
    assert 'data-testid="request-images"' in detail.content.decode() and "640 of these tokens" in detail.content.decode()
    response = client.get(reverse("console:requests-csv", kwargs={"slug": tenant.slug}))
    rows = {row["request_id"]: row for row in csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode()))}
    assert (rows[event["request_id"]]["image_count"], rows[event["request_id"]]["image_tokens"]) == ("2", "640")
    assert {rows[key]["image_count"] for key in rows if key != event["request_id"]} == {"0"}
    from tests.platform.conftest import client_for_key
    from tests.platform.factories import make_key

    api = client_for_key(make_key(tenant, scopes=("usage:read",))[1])
    shown = api.get(f"/api/v1/requests/{event['request_id']}").json()
    assert (shown["prompt_tokens"], shown["image_count"], shown["image_tokens"]) == (1200, 2, 640)
