"""Money under load: the budget holds under 200 concurrent requests on two gateways, every request leaves
exactly one usage row, every hold is released, and a revoked key stops working everywhere within a second."""

import asyncio
import time

import httpx
import openai
import pytest

from gateway.admission import held_totals
from metering.models import UsageEvent
from tests.gateway.conftest import BASE_MODEL, BUDGET_HOLD, BUDGET_TOKENS, client, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db]


def settled(tenant_id: int):
    """Waits until the tenant holds nothing (requests end asynchronously after a client hangs up)."""
    return wait_until(lambda: (t := held_totals(tenant_id=tenant_id)).live_holds == 0 and t, timeout=30,
                      what="every hold released")  # fmt: skip


def test_200_concurrent_requests_never_exceed_the_budget(stack):
    async def burst():
        limits = httpx.Limits(max_connections=200)
        apis = [
            openai.AsyncOpenAI(base_url=url, api_key=stack.keys["budget"], max_retries=0, timeout=120,
                               http_client=httpx.AsyncClient(limits=limits))  # fmt: skip
            for url in stack.gateways
        ]

        async def one(index: int):
            try:
                completion = await apis[index % 2].completions.create(model=BASE_MODEL, prompt="w10 w11", max_tokens=4)
                return completion.usage.total_tokens
            except openai.RateLimitError:
                return None

        try:
            return await asyncio.gather(*(one(i) for i in range(200)))
        finally:
            for api in apis:
                await api.close()

    results = asyncio.run(burst())
    served = [tokens for tokens in results if tokens is not None]
    assert served and len(served) < 200
    totals = settled(stack.ids["budget"])
    assert totals.held_tokens == 0
    assert totals.month_tokens == sum(served) <= BUDGET_TOKENS
    # Holds are upper bounds: while they were all in flight at most BUDGET_TOKENS / BUDGET_HOLD could run.
    assert len(served) >= BUDGET_TOKENS // BUDGET_HOLD


def test_every_request_leaves_exactly_one_usage_row(stack):
    api = client(stack, stack.keys["main"], gateway=1)
    messages = [{"role": "user", "content": "w40 w41 w42"}]
    whole = api.chat.completions.create(model="support", messages=messages, max_tokens=5)
    streamed = list(api.chat.completions.create(model="shouty", messages=messages, max_tokens=5, stream=True,
                                                stream_options={"include_usage": True}))  # fmt: skip
    aborted = api.chat.completions.create(model=BASE_MODEL, messages=messages, max_tokens=200, stream=True)
    aborted_id = aborted.response.headers["x-request-id"]
    next(iter(aborted))
    aborted.close()  # the client hangs up mid-stream

    reported = {
        whole.id.removeprefix("chatcmpl-"): whole.usage,
        streamed[-1].id.removeprefix("chatcmpl-"): streamed[-1].usage,
    }
    request_ids = [*reported, aborted_id]
    rows = wait_until(
        lambda: (found := list(UsageEvent.objects.filter(request_id__in=request_ids))) and len(found) == 3 and found,
        timeout=60, what="three usage rows ingested",
    )  # fmt: skip
    by_id = {row.request_id: row for row in rows}
    for request_id, usage in reported.items():
        row = by_id[request_id]
        assert (row.prompt_tokens, row.completion_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert by_id[aborted_id].completion_tokens >= 1
    # The gateway's metadata, echoed by the engine: the model as asked for, its version, the engine that served.
    assert sorted(row.model for row in rows) == sorted([BASE_MODEL, "shouty", "support"])
    assert all(row.engine == "engine-a" and row.cost is not None for row in rows)
    assert all((row.adapter_version_id is None) == (row.model == BASE_MODEL) for row in rows)
    time.sleep(1.0)  # a late duplicate would have arrived by now
    assert UsageEvent.objects.filter(request_id__in=request_ids).count() == 3
    totals = settled(stack.ids["main"])
    assert totals.held_tokens == 0


def test_a_revoked_key_is_refused_by_the_other_gateway_within_a_second(stack):
    plaintext = stack.keys["main-revocable"]
    other = client(stack, plaintext, gateway=1)
    assert other.models.list().data  # gateway 2 has the key cached now
    revoked = httpx.post(
        f"{stack.gateways[0].removesuffix('/v1')}/api/v1/keys/{stack.ids['key-main-revocable']}/revoke",
        headers={"Authorization": f"Bearer {stack.keys['main-admin']}"},
    )
    assert revoked.status_code == 200, revoked.text
    time.sleep(1.0)  # the key cache's lifetime
    with pytest.raises(openai.AuthenticationError) as raised:
        other.chat.completions.create(model=BASE_MODEL, messages=[{"role": "user", "content": "w7"}], max_tokens=2)
    assert "revoked" in raised.value.message
