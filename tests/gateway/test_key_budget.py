"""A key's own monthly budget, through the real stack (two gateways on Redis, the engine, the worker, PostgreSQL):
concurrent requests on the capped key never spend past its budget, the key is then refused with OpenAI's
insufficient_quota shape, and its sibling key of the same tenant still works."""

import asyncio

import httpx
import openai
import pytest

from gateway.admission import held_totals, key_spend_held, spend_to_picos
from metering.models import UsageEvent
from tests.gateway.conftest import BASE_MODEL, KEY_BUDGET, client, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db]


def test_a_key_over_its_budget_is_refused_while_its_sibling_still_works(stack):
    async def burst():
        apis = [
            openai.AsyncOpenAI(base_url=url, api_key=stack.keys["keyed-capped"], max_retries=0, timeout=120,
                               http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=60)))  # fmt: skip
            for url in stack.gateways
        ]

        async def one(index: int):
            try:
                return await apis[index % 2].completions.create(model=BASE_MODEL, prompt="w10 w11", max_tokens=4)
            except openai.RateLimitError as refused:
                return refused

        try:
            return await asyncio.gather(*(one(i) for i in range(60)))
        finally:
            for api in apis:
                await api.close()

    results = asyncio.run(burst())
    served = [result for result in results if not isinstance(result, openai.RateLimitError)]
    assert served and len(served) < 60
    tenant_id, prefix = stack.ids["keyed"], stack.ids["key-keyed-capped"]
    wait_until(lambda: held_totals(tenant_id=tenant_id).live_holds == 0, timeout=30, what="every hold released")
    spent = wait_until(
        lambda: (rows := list(UsageEvent.objects.filter(api_key_prefix=prefix))) and len(rows) == len(served) and rows,
        timeout=60, what="the served requests' usage recorded",
    )  # fmt: skip
    assert sum(row.price for row in spent) <= KEY_BUDGET  # zero overspend
    exact = spend_to_picos(sum(row.price for row in spent))  # the key's count is what its requests were billed
    wait_until(lambda: key_spend_held(tenant_id=tenant_id, key_prefix=prefix)[1] == exact, timeout=30,
               what="the key's spend settled from metering's record")  # fmt: skip

    capped = client(stack, stack.keys["keyed-capped"])
    refusal = None
    for _ in range(20):  # what is left of the budget fits fewer requests than this
        try:
            capped.completions.create(model=BASE_MODEL, prompt="w10 w11", max_tokens=4)
        except openai.RateLimitError as refused:
            refusal = refused
            if refused.code == "insufficient_quota":
                break
    assert refusal is not None and refusal.status_code == 429 and refusal.code == "insufficient_quota"
    assert refusal.body["type"] == "insufficient_quota" and "API key" in refusal.body["message"]
    sibling = client(stack, stack.keys["keyed-sibling"]).completions.create(model=BASE_MODEL, prompt="w10", max_tokens=2)
    assert sibling.usage.completion_tokens >= 1
