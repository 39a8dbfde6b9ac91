"""Disaggregated prefill/decode through the gateway, with real processes and the openai client: a prefill engine
that cannot be reached costs the client nothing (the request is served whole, the fallback is counted).
The package's gateways route a prompt whose uncached part is at least 32 tokens through a prefill engine
(QUILT_PREFILL_HOP_MIN_UNCACHED_TOKENS in the stack's environment)."""

import re
import time

import httpx
import pytest

from metering.models import UsageEvent
from tests.gateway.conftest import ENGINE_TOKEN, METRICS_TOKEN, client, free_port, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

SNAPSHOT = 1.0  # each gateway process re-reads its engines once a second
LONG = " ".join(f"w{i % 90 + 10}" for i in range(120))  # about 120 tokens, 480 characters
SHORT = "w10 w11"


def control_plane(stack) -> str:
    return stack.gateways[0].removesuffix("/v1")


def heartbeat(stack, name: str, url: str, *, role: str, draining: bool = False) -> None:
    """What an engine started with `--role` sends (the role is in its state: routing reads it there)."""
    body = {"name": name, "url": url, "pool": "default", "gpu_price_per_hour": "4.0", "interval_s": 30.0,
            "draining": draining, "state": {"role": role, "running": 0, "waiting": 0, "capacity": 8}}
    answer = httpx.post(f"{control_plane(stack)}/internal/engines/heartbeat", json=body, timeout=10,
                        headers={"Authorization": f"Bearer {ENGINE_TOKEN}"})  # fmt: skip
    assert answer.status_code == 200, answer.text


def counter(stack, name: str, label: str) -> float:
    text = httpx.get(f"{control_plane(stack)}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"},
                     timeout=10).text  # fmt: skip
    found = re.search(rf"^{name}_total\{{{label}\}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def ask(stack, content: str, max_tokens: int = 6):
    answer = client(stack, stack.keys["main"]).with_options(max_retries=0).chat.completions.with_raw_response.create(
        model="support", messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0)
    return answer.headers["x-request-id"], answer.parse()


def usage_row(request_id: str) -> UsageEvent:
    return wait_until(lambda: UsageEvent.objects.filter(request_id=request_id).first(), timeout=30,
                      what=f"the usage row of {request_id}")  # fmt: skip


def test_an_unreachable_prefill_engine_falls_back_to_one_engine(stack):
    _, colocated = ask(stack, LONG)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: as if killed after its last heartbeat
    heartbeat(stack, "prefill-dead", dead, role="prefill")
    try:
        time.sleep(SNAPSHOT + 0.2)
        before = counter(stack, "quilt_gateway_prefill_fallbacks", 'reason="unavailable"')
        request_id, answer = ask(stack, LONG)
        assert answer.choices[0].message.content == colocated.choices[0].message.content
        assert answer.usage.prompt_tokens == colocated.usage.prompt_tokens
        assert counter(stack, "quilt_gateway_prefill_fallbacks", 'reason="unavailable"') == before + 1
        row = usage_row(request_id)
        assert (row.engine, row.prefill_engine, row.prefill_gpu_ms) == ("engine-a", "", 0)
        # the failed engine is skipped for a while: the next long prompt is served whole without trying it
        _, again = ask(stack, LONG)
        assert again.choices[0].message.content == colocated.choices[0].message.content
        assert counter(stack, "quilt_gateway_prefill_fallbacks", 'reason="unavailable"') == before + 1
    finally:
        heartbeat(stack, "prefill-dead", dead, role="prefill", draining=True)
        time.sleep(SNAPSHOT + 0.2)
