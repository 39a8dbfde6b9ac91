"""Admission leases from outside: a busy key's requests through a real gateway on Redis are
admitted from leases (the gateway's metrics count them), every one is served, and once the gateway has given its
lease back nothing is held and admission's month counts exactly what metering billed: the tenant's tokens and the
key's spend to the pico-dollar."""

import asyncio
import re
from decimal import Decimal

import httpx
import pytest

from gateway.admission import held_totals, key_spend_held
from metering.models import UsageEvent
from tests.gateway.conftest import BASE_MODEL, METRICS_TOKEN, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

PICOS = Decimal(10) ** 12


def leases_taken(stack, tenant_id: int) -> float:
    text = httpx.get(stack.gateways[0].removesuffix("/v1") + "/metrics", timeout=10,
                     headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).text  # fmt: skip
    found = re.search(rf'^quilt_gateway_admission_leases_total{{tenant="{tenant_id}"}} (\S+)$', text, re.M)
    return float(found[1]) if found else 0.0


def test_a_busy_keys_requests_are_admitted_from_leases_and_billed_exactly(stack):
    key, prefix, tenant_id = stack.keys["busy"], stack.ids["key-busy"], stack.ids["busy"]
    before = leases_taken(stack, tenant_id)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {key}"}) as http:
            async def stream(index: int) -> list[httpx.Response]:
                answers = []
                for _ in range(10):
                    answers.append(await http.post(f"{stack.gateways[0]}/completions", json={
                        "model": BASE_MODEL, "prompt": f"w{index} w11", "max_tokens": 3, "temperature": 0,
                        "stream": index % 2 == 0}))  # fmt: skip
                return answers

            return [answer for answers in await asyncio.gather(*map(stream, range(6))) for answer in answers]

    answers = asyncio.run(burst())
    assert [answer.status_code for answer in answers] == [200] * 60, [a.text for a in answers if a.status_code != 200]
    assert leases_taken(stack, tenant_id) > before  # without leases: every request its own script
    served = [answer.headers["x-request-id"] for answer in answers]
    rows = wait_until(lambda: (r := list(UsageEvent.objects.filter(request_id__in=served))) and len(r) == 60 and r,
                      timeout=60, what="the served requests' usage")  # fmt: skip
    totals = wait_until(  # the gateway gives its idle lease back after a second; its slots are live holds till then
        lambda: (t := held_totals(tenant_id=tenant_id)).live_holds == 0 and t.provisional_tokens == 0 and t,
        timeout=30, what="the lease given back and every settle final")  # fmt: skip
    assert totals.held_tokens == 0
    assert totals.month_tokens == sum(row.prompt_tokens + row.completion_tokens for row in rows)
    held, spent = key_spend_held(tenant_id=tenant_id, key_prefix=prefix)
    assert held == 0 and Decimal(spent) == sum((row.price for row in rows), Decimal(0)) * PICOS
