"""Disaggregated prefill/decode through the gateway, with real processes and the openai client: a prefill engine
and a decode engine (`--role`) serve long prompts with the same greedy tokens, usage and price as one engine, the
prefill engine's GPU time costed at its own price; a short prompt skips the prefill hop; a prefill engine that
cannot be reached costs the client nothing (the request is served whole, the fallback is counted).
The package's gateways route a prompt whose uncached part is at least 32 tokens through a prefill engine
(QUILT_PREFILL_HOP_MIN_UNCACHED_TOKENS in the stack's environment)."""

import re
import signal
import time
from decimal import Decimal

import httpx
import openai
import pytest

from gateway.routing import routable_engines
from metering.models import UsageEvent
from metering.pricing import gpu_cost
from tests.engine_states import engine_state_json
from tests.gateway.conftest import (
    ENGINE_TOKEN,
    METRICS_TOKEN,
    client,
    engine_set,
    free_port,
    wait_for_engine,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

SNAPSHOT = 1.0  # each gateway process re-reads its engines once a second
LONG = " ".join(f"w{i % 90 + 10}" for i in range(120))  # about 120 tokens, 480 characters
SHORT = "w10 w11"


def control_plane(stack) -> str:
    return stack.gateways[0].removesuffix("/v1")


def heartbeat(stack, name: str, url: str, *, role: str, draining: bool = False, price: str = "4.0") -> None:
    """What an engine started with `--role` sends (the role is in its state: routing reads it there)."""
    body = {"name": name, "url": url, "pool": "default", "gpu_price_per_hour": price, "interval_s": 30.0,
            "draining": draining, "state": engine_state_json(role=role, capacity=8)}
    answer = httpx.post(f"{control_plane(stack)}/internal/engines/heartbeat", json=body, timeout=10,
                        headers={"Authorization": f"Bearer {ENGINE_TOKEN}"})  # fmt: skip
    assert answer.status_code == 200, answer.text


def counter(stack, name: str, label: str) -> float:
    text = httpx.get(f"{control_plane(stack)}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"},
                     timeout=10).text  # fmt: skip
    found = re.search(rf"^{name}_total\{{{label}\}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def ask(stack, content: str, max_tokens: int = 6, model: str = "support"):
    answer = client(stack, stack.keys["main"]).with_options(max_retries=0).chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0)
    return answer.headers["x-request-id"], answer.parse()


def ask_streamed(stack, content: str, max_tokens: int = 6, model: str = "support"):
    stream = client(stack, stack.keys["main"]).chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True})  # fmt: skip
    request_id = stream.response.headers["x-request-id"]
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return request_id, text, chunks[-1].usage


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


PREFILL_PRICE, DECODE_PRICE = Decimal("3.0"), Decimal("1.25")
PROMPTS = {  # long, and each new to every engine: nothing cached anywhere, so colocated and split price alike
    "support": " ".join(f"w{(i * 7) % 90 + 10}" for i in range(110)),
    "shouty": " ".join(f"w{(i * 11) % 90 + 10}" for i in range(100)),
    "tiny": " ".join(f"w{(i * 13) % 90 + 10}" for i in range(105)),
}
PAST_CONTEXT = " ".join(f"w{(i * 17) % 90 + 10}" for i in range(300))  # the stack's model holds 256 tokens


@pytest.fixture(scope="module")
def split_fleet(stack, django_db_blocker):
    """The colocated answers first (engine-a alone), then a prefill and a decode engine in its place."""
    colocated = {model: ask(stack, prompt, model=model) for model, prompt in PROMPTS.items()}
    streamed = ask_streamed(stack, PROMPTS["support"] + " w42", max_tokens=8)
    with pytest.raises(openai.BadRequestError) as raised:
        ask(stack, PAST_CONTEXT)
    past_context = (raised.value.status_code, raised.value.code, raised.value.param, raised.value.message)
    control = control_plane(stack)
    engines, ports = {}, {}
    # the prefill engine heartbeats every 5 s: stopped (SIGSTOP) it stays in routing for 15 s, long enough to hang
    for name, role, price, beat in (("pd-prefill", "prefill", PREFILL_PRICE, "5"),
                                    ("pd-decode", "decode", DECODE_PRICE, "0.5")):  # fmt: skip
        port = free_port()
        ports[name] = port
        engines[name] = stack.launch_engine(name, port, extra=(
            "--control-plane", control, "--engine-name", name, "--heartbeat-interval", beat, "--role", role,
            "--gpu-price-per-hour", str(price), "--leave-grace", "0.5",
        ))  # fmt: skip
    with django_db_blocker.unblock():
        engine_set("engine-a", enabled=False)
    try:
        for process in engines.values():
            wait_for_engine(process)
        with django_db_blocker.unblock():
            wait_until(lambda: {"pd-prefill", "pd-decode"} <= set(routable_engines().values_list("name", flat=True)),
                       timeout=10, what="both engines in routing")  # fmt: skip
        time.sleep(SNAPSHOT + 0.2)
        yield colocated, streamed, engines, past_context
    finally:
        for process in engines.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.send_signal(signal.SIGTERM)
        for process in engines.values():
            process.wait(timeout=30)
        # a killed engine says no goodbye: its last heartbeat would keep it routed (as prefill-only) for 15 s more
        heartbeat(stack, "pd-prefill", f"http://127.0.0.1:{ports['pd-prefill']}", role="prefill", draining=True,
                  price=str(PREFILL_PRICE))
        with django_db_blocker.unblock():
            engine_set("engine-a", enabled=True)
        time.sleep(SNAPSHOT + 0.2)


def test_a_split_fleet_gives_the_same_tokens_usage_and_price_and_costs_both_engines(stack, split_fleet):
    colocated, _, _, _ = split_fleet
    before = {outcome: counter(stack, "quilt_gateway_kv_transfers", f'outcome="{outcome}"')
              for outcome in ("pulled", "recomputed")}
    routed = counter(stack, "quilt_gateway_disaggregation", 'route="disaggregated"')
    for model, prompt in PROMPTS.items():  # two adapters and the base model
        request_id, answer = ask(stack, prompt, model=model)
        reference_id, reference = colocated[model]
        assert answer.choices[0].message.content == reference.choices[0].message.content, model
        assert answer.usage.model_dump() == reference.usage.model_dump(), model
        row, one = usage_row(request_id), usage_row(reference_id)
        assert (row.engine, row.prefill_engine, one.engine, one.prefill_engine) == ("pd-decode", "pd-prefill",
                                                                                    "engine-a", "")  # fmt: skip
        assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens, row.price) == (
            one.prompt_tokens, one.cached_tokens, one.completion_tokens, one.price)
        assert 0 < row.prefill_gpu_ms < row.gpu_ms  # the prefill engine's GPU time is recorded, within the total
        assert row.cost == (gpu_cost(gpu_ms=row.gpu_ms - row.prefill_gpu_ms, gpu_price_per_hour=DECODE_PRICE)
                            + gpu_cost(gpu_ms=row.prefill_gpu_ms, gpu_price_per_hour=PREFILL_PRICE))
    assert counter(stack, "quilt_gateway_disaggregation", 'route="disaggregated"') == routed + len(PROMPTS)
    assert counter(stack, "quilt_gateway_kv_transfers", 'outcome="pulled"') == before["pulled"] + len(PROMPTS)
    assert counter(stack, "quilt_gateway_kv_transfers", 'outcome="recomputed"') == before["recomputed"]


def test_a_streamed_split_request_streams_as_one_engine_does(stack, split_fleet):
    _, (reference_id, reference_text, reference_usage), _, _ = split_fleet
    request_id, text, usage = ask_streamed(stack, PROMPTS["support"] + " w42", max_tokens=8)
    assert text == reference_text and usage.model_dump() == reference_usage.model_dump()
    row = usage_row(request_id)
    assert (row.engine, row.prefill_engine) == ("pd-decode", "pd-prefill") and row.prefill_gpu_ms > 0


def test_a_short_prompt_skips_the_prefill_hop(stack, split_fleet):
    skipped = counter(stack, "quilt_gateway_disaggregation", 'route="short"')
    request_id, answer = ask(stack, SHORT)
    assert answer.choices[0].finish_reason in ("stop", "length")
    row = usage_row(request_id)
    assert (row.engine, row.prefill_engine, row.prefill_gpu_ms) == ("pd-decode", "", 0)
    assert counter(stack, "quilt_gateway_disaggregation", 'route="short"') == skipped + 1


def test_a_prompt_past_the_context_is_the_clients_400_not_a_prefill_fallback(stack, split_fleet):
    """The prefill engine refuses it as any engine would: the client hears that at once, no fallback is counted and
    the decode engine is not asked (the refusal is not a failed hop that sends the request on)."""
    colocated_error = split_fleet[3]
    fallbacks = counter(stack, "quilt_gateway_prefill_fallbacks", 'reason="refused"')
    refused = counter(stack, "quilt_gateway_disaggregation", 'route="refused"')
    with pytest.raises(openai.BadRequestError) as raised:
        ask(stack, PAST_CONTEXT)
    error = raised.value
    assert (error.status_code, error.code, error.param, error.message) == colocated_error
    assert counter(stack, "quilt_gateway_prefill_fallbacks", 'reason="refused"') == fallbacks
    assert counter(stack, "quilt_gateway_disaggregation", 'route="refused"') == refused + 1


def engine_state(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/v1/state", headers={"Authorization": f"Bearer {ENGINE_TOKEN}"},
                     timeout=5).json()  # fmt: skip


def test_a_prefill_engine_advertised_by_a_name_with_an_underscore_costs_the_client_nothing(stack, split_fleet,
                                                                                           django_db_blocker):
    """A prefill engine reached as http://engine_prefill:PORT (a compose service's name) puts that host in its leases.
    The decode engine takes the address (it does not refuse it as malformed, a 400 for every split request, each
    lease held until its TTL); where it cannot pull (here the name does not resolve) it recomputes, and the gateway
    ends the unpulled lease at once."""
    port = free_port()
    process = stack.launch_engine("pd-prefill-u", port, extra=(
        "--role", "prefill", "--advertise-url", f"http://engine_prefill:{port}"))  # fmt: skip
    with django_db_blocker.unblock():
        engine_set("pd-prefill", enabled=False)
    try:
        wait_for_engine(process)
        warm = httpx.post(f"http://127.0.0.1:{port}/v1/generate", headers={"Authorization": f"Bearer {ENGINE_TOKEN}"},
                          json={"prompt": SHORT, "stream": False, "sampling": {"max_tokens": 2}}, timeout=60)
        assert warm.status_code == 200, warm.text  # its first request's warm-up would outlast the hop's 3 s timeout
        heartbeat(stack, "pd-prefill-u", f"http://127.0.0.1:{port}", role="prefill")
        time.sleep(SNAPSHOT + 0.2)
        prompt = " ".join(f"w{(i * 19) % 90 + 10}" for i in range(100))
        routed = counter(stack, "quilt_gateway_disaggregation", 'route="disaggregated"')
        recomputed = counter(stack, "quilt_gateway_kv_transfers", 'outcome="recomputed"')
        request_id, answer = ask(stack, prompt)  # no 400
        assert counter(stack, "quilt_gateway_disaggregation", 'route="disaggregated"') == routed + 1
        assert counter(stack, "quilt_gateway_kv_transfers", 'outcome="recomputed"') == recomputed + 1
        row = usage_row(request_id)
        assert (row.engine, row.prefill_engine) == ("pd-decode", "pd-prefill-u")
        # the lease ended as the gateway told the prefill engine (released), well before its 5 s TTL (expired)
        leases = wait_until(lambda: (s := engine_state(port))["kv_leases"]["active"] == 0 and s["kv_leases"],
                            timeout=4, what="the unpulled lease ended")  # fmt: skip
        assert leases["released"] == {"released": 1}, leases
        engine_set("pd-prefill-u", enabled=False)
        time.sleep(SNAPSHOT + 0.2)
        _, whole = ask(stack, prompt)  # the same prompt on the decode engine alone: the same tokens
        assert answer.choices[0].message.content == whole.choices[0].message.content
    finally:
        process.terminate()
        process.wait(timeout=30)
        heartbeat(stack, "pd-prefill-u", f"http://127.0.0.1:{port}", role="prefill", draining=True)
        with django_db_blocker.unblock():
            engine_set("pd-prefill", enabled=True)
        time.sleep(SNAPSHOT + 0.2)


def test_a_client_that_leaves_during_the_prefill_hop_leaves_no_lease_or_block_behind(stack, split_fleet):
    _, _, engines, _ = split_fleet
    prefill = engines["pd-prefill"]
    state_url = prefill.health_url.removesuffix("/health") + "/state"
    # The hop hangs until the client has gone. Resumed, the engine may still finish the prefill and grant a lease
    # before it hears that the gateway hung up: nobody will pull it, and its TTL (5 s in the stack's environment)
    # releases it.
    prefill.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(openai.APITimeoutError):
            client(stack, stack.keys["main"]).with_options(timeout=1.0).chat.completions.create(
                model="support", messages=[{"role": "user", "content": PROMPTS["support"] + " w77 w78"}], max_tokens=4)
    finally:
        prefill.send_signal(signal.SIGCONT)

    seen = {}

    def settled():
        state = seen["state"] = httpx.get(state_url, headers={"Authorization": f"Bearer {ENGINE_TOKEN}"}, timeout=5).json()
        idle = state["running"] == 0 and state["waiting"] == 0 and state["kv_leases"]["active"] == 0
        return state if idle else None

    try:
        state = wait_until(settled, timeout=15, what="the prefill engine idle with no lease")
    except TimeoutError:
        pytest.fail(f"the prefill engine kept work or a lease: {dict((k, seen['state'].get(k)) for k in ('running', 'waiting', 'kv_leases', 'kv_pool'))}")
    pool = state["kv_pool"]  # the pool's own counts: nothing held, nothing lost
    assert pool["held"] == 0
    assert pool["free"] + pool["evictable"] + pool["in_use"] + pool["adapter_pages"] == pool["total"]


def test_a_hung_prefill_engine_times_out_and_the_request_is_served_whole(stack, split_fleet):
    """QUILT_PREFILL_HOP_TIMEOUT_SECONDS is 3 in the stack's environment."""
    colocated, _, engines, _ = split_fleet
    before = counter(stack, "quilt_gateway_prefill_fallbacks", 'reason="timeout"')
    engines["pd-prefill"].send_signal(signal.SIGSTOP)  # its socket still accepts; nothing answers
    try:
        started = time.monotonic()
        request_id, answer = ask(stack, PROMPTS["tiny"], model="tiny")
        assert 3 <= time.monotonic() - started < 20
    finally:
        engines["pd-prefill"].send_signal(signal.SIGCONT)
    assert answer.choices[0].message.content == colocated["tiny"][1].choices[0].message.content
    assert counter(stack, "quilt_gateway_prefill_fallbacks", 'reason="timeout"') == before + 1
    row = usage_row(request_id)
    assert (row.engine, row.prefill_engine, row.prefill_gpu_ms) == ("pd-decode", "", 0)


def test_a_killed_prefill_engine_costs_the_client_nothing(stack, split_fleet):
    colocated, _, engines, _ = split_fleet
    time.sleep(5.5)  # the previous test's timeout set the prefill engine aside for 5 s
    before = counter(stack, "quilt_gateway_prefill_fallbacks", 'reason="unavailable"')
    engines["pd-prefill"].send_signal(signal.SIGKILL)
    engines["pd-prefill"].wait()
    request_id, answer = ask(stack, PROMPTS["shouty"], model="shouty")  # still in routing: its heartbeat is recent
    assert answer.choices[0].message.content == colocated["shouty"][1].choices[0].message.content
    assert counter(stack, "quilt_gateway_prefill_fallbacks", 'reason="unavailable"') == before + 1
    assert usage_row(request_id).prefill_engine == ""
