"""The request log tells the whole truth, seen from outside: every request the gateway answers is in it (refusals
with their status, reason and key), the error chart counts them, and logged times start at the gateway's receipt
of the request, with the engine's own beside them."""

import time
from datetime import UTC, datetime, timedelta

import httpx
import openai
import pytest

from tests.gateway.conftest import BASE_MODEL, client, wait_until

pytestmark = [pytest.mark.django_db, pytest.mark.slow]

CHAT = [{"role": "user", "content": "w20 w21 w22"}]


def _logged(stack, key: str, request_id: str, *, until=lambda row: True) -> dict:
    """The log API's row for a request, once it is there (and `until` holds for it)."""
    url = stack.gateways[0].removesuffix("/v1") + f"/api/v1/requests/{request_id}"

    def row():
        response = httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=10)
        return response.status_code == 200 and until(response.json()) and response.json()

    return wait_until(row, timeout=30, what=f"request {request_id} in the log")


def _refused(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as raised:
        call()
    return raised.value


def test_refusals_are_logged_with_their_status_reason_and_key_and_counted_as_errors(stack):
    from metering.selectors import usage_buckets
    from tenancy.models import Tenant

    broke = client(stack, stack.keys["broke"])
    started = datetime.now(UTC)
    refusals = {
        400: _refused(lambda: broke.chat.completions.create(model=BASE_MODEL, messages=CHAT, temperature=5)),
        404: _refused(lambda: broke.chat.completions.create(model="no-such-model", messages=CHAT)),
        429: _refused(lambda: broke.chat.completions.create(model=BASE_MODEL, messages=CHAT, max_tokens=2)),
    }
    for status, error in refusals.items():
        assert error.status_code == status
        row = _logged(stack, stack.keys["broke-reader"], error.response.headers["x-request-id"])
        assert (row["status"], row["status_code"], row["error_code"]) == ("refused", status, error.code or "")
        assert row["api_key"] == stack.ids["key-broke"] and row["error"] == error.body["message"]
        assert (row["prompt_tokens"], row["completion_tokens"], row["cost"]) == (0, 0, "0.000000000000")
    listed = httpx.get(stack.gateways[0].removesuffix("/v1") + "/api/v1/requests?status=refused",
                       headers={"Authorization": f"Bearer {stack.keys['broke-reader']}"}).json()["data"]  # fmt: skip
    assert {error.response.headers["x-request-id"] for error in refusals.values()} <= {r["request_id"] for r in listed}

    buckets = usage_buckets(tenant=Tenant.objects.get(slug="gw-broke"), since=started - timedelta(hours=1),
                            until=started + timedelta(hours=1), bucket="hour")  # fmt: skip
    assert sum(b.refused for b in buckets) >= 3 and sum(b.errors for b in buckets) >= 3
    assert sum(b.prompt_tokens for b in buckets) == 0


def test_logged_times_start_at_the_gateways_receipt_with_the_engines_beside_them(stack):
    main = client(stack, stack.keys["main"])
    sent = time.monotonic()
    raw = main.chat.completions.with_raw_response.create(model=BASE_MODEL, messages=CHAT, max_tokens=4, stream=True)
    chunks = list(raw.parse())
    seen_ms = (time.monotonic() - sent) * 1000
    assert chunks
    row = _logged(stack, stack.keys["main-admin"], raw.headers["x-request-id"],
                  until=lambda row: row["status_code"] is not None)  # fmt: skip
    assert row["status"] == "ok" and row["status_code"] == 200
    assert row["engine_e2e_ms"] < row["e2e_ms"] <= seen_ms  # the gateway's own time is in, the network's is not
    assert row["engine_ttft_ms"] < row["ttft_ms"] < row["e2e_ms"]
