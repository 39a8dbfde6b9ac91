"""An API key's money and limits as its owner sees them from outside (two gateways on Redis, the engine, the worker,
PostgreSQL): its spend counted exactly as it is billed, its budget kept across a rotation, its tokens per minute
counted in the base model's tokens, and its own limits in the x-ratelimit-* headers of its calls where they are the
nearer ones: of the refusals they cause, and of admitted calls."""

import re
import time
from decimal import Decimal

import httpx
import pytest

from gateway.admission import held_totals, key_spend_held
from metering.models import UsageEvent
from tests.gateway.conftest import BASE_MODEL, EXACT_KEY_BUDGET, EXACT_KEY_SPENT, KEY_TPM, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

PICOS = Decimal(10) ** 12


def complete(stack, key: str, body: dict, *, route: str = "completions", gateway: int = 0) -> httpx.Response:
    return httpx.post(f"{stack.gateways[gateway]}/{route}", json={"model": BASE_MODEL, **body}, timeout=60,
                      headers={"Authorization": f"Bearer {key}"})  # fmt: skip


def test_a_keys_budget_is_spent_to_the_last_fraction_of_a_micro_dollar(stack):
    """The key has 40 micro-dollars of its budget left; each request holds and costs at most 2.1 (2 prompt tokens at
    $0.15, 3 completion tokens at $0.60 per million). Counted as billed (not in whole micro-dollars rounded up per
    request, which would refuse it with a third of that unspent), it is refused only when what it was billed plus
    the next request's hold passes the budget."""
    key, prefix, tenant_id = stack.keys["exact"], stack.ids["key-exact"], stack.ids["exact"]
    served, refused = [], None
    for _ in range(80):
        response = complete(stack, key, {"prompt": "w10 w11", "max_tokens": 3, "temperature": 0}, gateway=len(served) % 2)
        if response.status_code == 429:
            refused = response
            break
        assert response.status_code == 200, response.text
        served.append(response.headers["x-request-id"])
    assert refused is not None and refused.json()["error"]["code"] == "insufficient_quota"
    rows = wait_until(lambda: (r := list(UsageEvent.objects.filter(request_id__in=served))) and len(r) == len(served) and r,
                      timeout=60, what="the served requests' usage")  # fmt: skip
    billed = sum((row.price for row in rows), Decimal(0))
    hold = Decimal(2 * 15 + 3 * 60) / 10**8  # the refused request's hold: its 2 prompt tokens, max_tokens 3
    assert served and EXACT_KEY_SPENT + billed <= EXACT_KEY_BUDGET < EXACT_KEY_SPENT + billed + hold, (billed, len(served))
    wait_until(lambda: held_totals(tenant_id=tenant_id).provisional_tokens == 0, timeout=30, what="every settle final")
    held, spent = key_spend_held(tenant_id=tenant_id, key_prefix=prefix)
    assert held == 0 and Decimal(spent) == (EXACT_KEY_SPENT + billed) * PICOS  # the invoice's count, to the pico-dollar


def test_rotating_a_key_keeps_its_months_spend_against_its_budget(stack):
    old_key, tenant_id = stack.keys["keyed-rotating"], stack.ids["keyed"]
    body = {"prompt": "w10 w11", "max_tokens": 4, "temperature": 0}
    served = 0
    for _ in range(10):  # two requests fit its budget
        response = complete(stack, old_key, body)
        if response.status_code == 429:
            break
        assert response.status_code == 200, response.text
        served += 1
    assert response.status_code == 429 and response.json()["error"]["code"] == "insufficient_quota"
    api = stack.gateways[0].removesuffix("/v1") + "/api/v1"
    rotated = httpx.post(f"{api}/keys/{stack.ids['key-keyed-rotating']}/rotate", json={"grace_seconds": 0}, timeout=60,
                         headers={"Authorization": f"Bearer {stack.keys['keyed-admin']}"})  # fmt: skip
    assert rotated.status_code == 201, rotated.text
    new_key = rotated.json()["key"]
    again = wait_until(lambda: (r := complete(stack, new_key, body)).status_code != 401 and r, timeout=10,
                       what="the successor accepted")  # fmt: skip
    assert again.status_code == 429, again.text  # the budget was spent by the lineage, not by one secret
    assert again.json()["error"]["code"] == "insufficient_quota"
    lineage = UsageEvent.objects.filter(api_key_prefix=stack.ids["key-keyed-rotating"])
    wait_until(lambda: lineage.count() >= served, timeout=60, what="the served requests' usage")  # ingested later
    spent = sum(lineage.values_list("price", flat=True))
    held, counted = key_spend_held(tenant_id=tenant_id, key_prefix=stack.ids["key-keyed-rotating"])
    assert held == 0 and Decimal(counted) == spent * PICOS


def same_minute(seconds: float) -> None:
    """Waits, if need be, until the next `seconds` fall within one minute window (admission's windows are the
    clock's minutes)."""
    while time.time() % 60 > 60 - seconds:
        time.sleep(0.2)


def test_tokens_per_minute_count_the_base_models_tokens_and_the_refusal_says_the_real_need(stack):
    """59 words of the tiny model's word-level vocabulary are 59 tokens (the chat template adds a few): with
    max_tokens 20 that fits a key's 120 tokens per minute, which the prompt's 230 bytes did not."""
    key = stack.keys["keyed-tpm"]
    content = " ".join(f"w{i}" for i in range(10, 69))
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 20, "temperature": 0}
    same_minute(15)
    first = complete(stack, key, body, route="chat/completions")
    assert first.status_code == 200, first.text
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    assert 59 <= prompt_tokens < 70
    assert first.headers["x-ratelimit-limit-tokens"] == str(KEY_TPM)  # admitted: the key's is the nearer limit
    assert first.headers["x-ratelimit-remaining-tokens"] == str(KEY_TPM - prompt_tokens - 20)
    second = complete(stack, key, body, route="chat/completions")
    assert second.status_code == 429, second.text  # what the first used leaves less than the second needs
    message = second.json()["error"]["message"]
    needs = int(re.search(r"needs (\d+) tokens", message).group(1))
    assert needs == prompt_tokens + 20, message
    assert f"of its {KEY_TPM} tokens per minute" in message
    assert second.headers["x-ratelimit-limit-tokens"] == str(KEY_TPM)  # the key's limit refused it, not the plan's
    used = first.json()["usage"]["total_tokens"]
    assert second.headers["x-ratelimit-remaining-tokens"] == str(KEY_TPM - used)


def test_a_keys_request_limit_is_reported_in_the_headers_of_its_calls_and_its_refusal(stack):
    key = stack.keys["keyed-rpm"]
    same_minute(15)
    statuses = [complete(stack, key, {"prompt": "w10", "max_tokens": 1}) for _ in range(3)]
    assert [r.status_code for r in statuses] == [200, 200, 429], statuses[-1].text
    admitted = [(r.headers["x-ratelimit-limit-requests"], r.headers["x-ratelimit-remaining-requests"]) for r in statuses[:2]]
    assert admitted == [("2", "1"), ("2", "0")]  # the key's limit, not the plan's 10,000: it is the nearer one
    refused = statuses[-1]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded" and "API key" in refused.json()["error"]["message"]
    assert refused.headers["x-ratelimit-limit-requests"] == "2"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert float(refused.headers["retry-after"]) >= 1
    # calls answered without an admission (a listing, a refusal after the key check) read the key's window too
    listing = httpx.get(f"{stack.gateways[0]}/models", headers={"Authorization": f"Bearer {key}"}, timeout=60)
    unknown = complete(stack, key, {"model": "no-such-model", "prompt": "w10", "max_tokens": 1})
    assert (listing.status_code, unknown.status_code) == (200, 404), unknown.text
    for response in (listing, unknown):
        told = (response.headers["x-ratelimit-limit-requests"], response.headers["x-ratelimit-remaining-requests"])
        assert told == ("2", "0"), response.text
