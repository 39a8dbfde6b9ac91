"""GET /api/v1/usage: the caller's tenant only, grouped by day, model or key, as JSON or CSV."""

import csv
import io
from datetime import UTC, datetime

import pytest

from metering.rollups import usage_rollup_recent
from metering.services import usage_ingest
from tests.metering.usage import gpu_engine, priced_tenant, usage_event
from tests.platform.conftest import client_for_key, client_for_member
from tests.platform.factories import MembershipFactory, make_key

pytestmark = pytest.mark.django_db

OCT = "start=2026-10-01&end=2026-10-31"


@pytest.fixture
def usage():
    gpu_engine()
    acme, globex = priced_tenant("acme"), priced_tenant("globex")
    key_a, plaintext = make_key(acme, scopes=["usage:read"])
    key_b, _ = make_key(acme, scopes=["inference"], name="second")
    events = [
        usage_event(acme, model="tiny-llama", api_key_id=key_a.prefix, finished_at=datetime(2026, 10, 2, 9, tzinfo=UTC)),
        usage_event(acme, model="support-bot", api_key_id=key_a.prefix, finished_at=datetime(2026, 10, 2, 10, tzinfo=UTC)),
        usage_event(acme, model="support-bot", api_key_id=key_b.prefix, finished_at=datetime(2026, 10, 9, 1, tzinfo=UTC)),
        usage_event(globex, model="globex-secret", finished_at=datetime(2026, 10, 2, 9, tzinfo=UTC)),
    ]  # fmt: skip
    usage_ingest(events=events)
    usage_rollup_recent()
    return {"acme": acme, "client": client_for_key(plaintext), "key_a": key_a, "key_b": key_b}


def test_grouped_by_day_model_and_key(usage):
    client = usage["client"]
    by_day = client.get(f"/api/v1/usage?{OCT}&group_by=day").json()
    assert [(row["group"], row["requests"]) for row in by_day["data"]] == [
        ("2026-10-02", 2),
        ("2026-10-09", 1),
    ]
    assert by_day["total"]["requests"] == 3 and by_day["total"]["total_tokens"] == 3 * 1300
    assert by_day["total"]["price"] == "0.002625"  # 3 × 0.000875, a string: Decimal, never a float
    by_model = client.get(f"/api/v1/usage?{OCT}&group_by=model").json()["data"]
    assert {row["group"]: row["requests"] for row in by_model} == {"support-bot": 2, "tiny-llama": 1}
    by_key = client.get(f"/api/v1/usage?{OCT}&group_by=key").json()["data"]
    assert {row["group"]: row["requests"] for row in by_key} == {
        usage["key_a"].prefix: 2,
        usage["key_b"].prefix: 1,
    }
    assert "cost" not in by_day["total"]
    one_day = client.get("/api/v1/usage?start=2026-10-09&end=2026-10-09").json()
    assert one_day["total"]["requests"] == 1


@pytest.mark.parametrize("path", ["/api/v1/usage.csv?", "/api/v1/usage?format=csv&"])
def test_csv(usage, path):
    response = usage["client"].get(f"{path}{OCT}&group_by=model")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    assert "attachment" in response["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [(row["model"], row["requests"], row["price"]) for row in rows] == [
        ("support-bot", "2", "0.001750"),
        ("tiny-llama", "1", "0.000875"),
    ]


def test_an_empty_range_is_a_header_only_csv(usage):
    response = usage["client"].get("/api/v1/usage.csv?start=2025-01-01&end=2025-01-31")
    assert response.content.decode().splitlines() == [
        "day,requests,prompt_tokens,cached_tokens,completion_tokens,total_tokens,price"
    ]


def test_access_needs_usage_read_or_a_viewer_membership(usage):
    _, plaintext = make_key(usage["acme"], scopes=["inference"])
    refused = client_for_key(plaintext).get("/api/v1/usage")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "insufficient_scope"
    viewer = client_for_member(MembershipFactory(tenant=usage["acme"], role="viewer"))
    assert viewer.get(f"/api/v1/usage?{OCT}").json()["total"]["requests"] == 3


def test_another_tenants_usage_never_shows(usage):
    data = usage["client"].get(f"/api/v1/usage?{OCT}&group_by=model").json()["data"]
    assert "globex-secret" not in {row["group"] for row in data}
    initech_owner = client_for_member(MembershipFactory(tenant=priced_tenant("initech"), role="owner"))
    assert initech_owner.get(f"/api/v1/usage?{OCT}").json()["total"]["requests"] == 0


@pytest.mark.parametrize(
    "query",
    [
        "group_by=week",
        "start=yesterday",
        # blank values are mistakes, not "use the default"
        "start=",
        "end=",
        "group_by=",
        "start=2026-10-01&end=",
        # only YYYY-MM-DD, the format the error message names
        "start=2026-1-5&end=2026-1-6",
        "start=20261001",
        "start=%D9%A2%D9%A0%D9%A2%D9%A6-10-01",  # Arabic-Indic digits
        "start=2026-10-01T00:00:00Z",
        "start=2026-02-30",
        "start=%00",
        # a misspelt parameter is not silently the default range
        "since=2026-10-01",
        "group-by=model",
    ],
)
def test_bad_queries_are_400(usage, query):
    response = usage["client"].get(f"/api/v1/usage?{query}")
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize(("query", "word"), [
    ("start=", "start"), ("end=2026-10-32", "end"), ("group_by=week", "group_by"), ("since=2026-10-01", "since"),
    ("start=9999-12-01&end=9999-12-31", "end"), ("start=2026-10-31&end=2026-10-01", "start"),
])  # fmt: skip
def test_a_bad_query_says_which_parameter(usage, query, word):
    assert word in usage["client"].get(f"/api/v1/usage?{query}").json()["error"]["message"]


def test_a_bad_query_on_the_csv_export_is_400_too(usage):
    response = usage["client"].get("/api/v1/usage.csv?start=2026-13-01")
    assert response.status_code == 400 and b"start" in response.content


def test_a_range_ending_in_the_future_is_fine(usage):
    response = usage["client"].get("/api/v1/usage?start=2099-01-01&end=2099-12-31&format=json")
    assert response.status_code == 200 and response.json()["end"] == "2099-12-31"


@pytest.mark.parametrize("query", [
    "start=2026-10-31&end=2026-10-01",  # reversed
    "start=2020-01-01&end=2026-01-01",  # longer than a query may ask for
    "start=9999-12-01&end=9999-12-31",  # the last day a date can name has no "next day" to end the range
])  # fmt: skip
def test_a_range_of_valid_days_that_can_not_be_served_is_422(usage, query):
    """Each day is as the schema says; the range they make is what is refused: 422, so a 400 always means a
    request the schema itself refuses (tests/security/test_schemathesis.py)."""
    response = usage["client"].get(f"/api/v1/usage?{query}")
    assert response.status_code == 422, response.content
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_range" and error["message"]
