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


def test_a_refusal_before_the_key_check_is_logged_as_anonymous_with_the_keys_prefix_never_its_secret(stack):
    """A 401 (no key, a wrong secret) or a 413 (a body past the limit, answered before the key is read) has no
    tenant's log to go to: it is in the staff's log as an anonymous refusal, naming the prefix of the key the request
    presented, if any (the part before the dot), and never its secret."""
    from metering.models import REFUSED, UsageEvent

    url, prefix = f"{stack.gateways[0]}/chat/completions", stack.ids["key-broke"]
    body = {"model": BASE_MODEL, "messages": CHAT}
    wrong = f"{prefix}.wrong-secret-{time.time_ns()}"
    answers = {
        "no key": (httpx.post(url, json=body, timeout=30), 401, ""),
        "wrong secret": (httpx.post(url, json=body, headers={"Authorization": f"Bearer {wrong}"}, timeout=30), 401,
                         prefix),
        "no prefix": (httpx.post(url, json=body, headers={"Authorization": "Bearer sk-not-ours"}, timeout=30), 401, ""),
        "too large": (httpx.post(url, content=b"{" + b" " * (2 * 1024**2 + 1), timeout=30,
                                 headers={"Authorization": f"Bearer {stack.keys['broke']}",
                                          "Content-Type": "application/json"}), 413, prefix),
    }  # fmt: skip
    for case, (response, status, logged_prefix) in answers.items():
        assert response.status_code == status, (case, response.text)
        request_id = response.headers["x-request-id"]
        row = wait_until(lambda: UsageEvent.answered.filter(request_id=request_id).first(), timeout=30,  # noqa: B023
                         what=f"the {case} refusal in the log")  # fmt: skip
        assert (row.tenant_id, row.api_key_id, row.api_key_prefix) == (None, None, logged_prefix), case
        assert (row.finish_reason, row.status_code, row.error_code) == (REFUSED, status, response.json()["error"]["code"])
        assert "wrong-secret" not in " ".join(str(value) for value in vars(row).values()), case
    listed = httpx.get(stack.gateways[0].removesuffix("/v1") + "/api/v1/requests?status=refused",
                       headers={"Authorization": f"Bearer {stack.keys['broke-reader']}"}).json()["data"]  # fmt: skip
    assert not {response.headers["x-request-id"] for response, _, _ in answers.values()} & {r["request_id"] for r in listed}
