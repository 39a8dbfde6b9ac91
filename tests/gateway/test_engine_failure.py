"""Engines failing: one killed mid-stream ends the client's stream with an error, releases the hold and leaves a
usage row of what was served; one that is gone before answering is retried on another."""

import signal
import time

import openai
import pytest

from gateway.admission import held_totals
from metering.models import UsageEvent
from tests.gateway.conftest import (
    BASE_MODEL,
    client,
    engine_set,
    free_port,
    register_engine,
    wait_for_engine,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

SNAPSHOT_SECONDS = 1.1  # each gateway re-reads the engine list once a second


@pytest.fixture(scope="module")
def lone_engine(stack, django_db_blocker):
    """A second engine that takes all the traffic while it lives (the first is disabled meanwhile)."""
    from gateway.models import Engine

    port = free_port()
    process = stack.launch_engine("engine-b", port)
    wait_for_engine(process)
    with django_db_blocker.unblock():
        register_engine("engine-b", f"http://127.0.0.1:{port}")
        Engine.objects.filter(name="engine-a").update(enabled=False)
    time.sleep(SNAPSHOT_SECONDS)
    yield process
    if process.poll() is None:
        process.kill()
    with django_db_blocker.unblock():
        Engine.objects.filter(name="engine-b").delete()
        Engine.objects.filter(name="engine-a").update(enabled=True)
    time.sleep(SNAPSHOT_SECONDS)


def test_engine_killed_mid_stream(stack, lone_engine):
    process = lone_engine
    api = client(stack, stack.keys["main"])
    stream = api.chat.completions.create(
        model="support", messages=[{"role": "user", "content": "w50 w51"}], max_tokens=200, stream=True,
        frequency_penalty=-2.0,  # repeat rather than stop: the stream must still be running when the engine dies
    )  # fmt: skip
    request_id = stream.response.headers["x-request-id"]
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices[0].delta.role == "assistant"
    process.send_signal(signal.SIGKILL)
    with pytest.raises(openai.APIError) as raised:
        for _ in chunks:
            pass
    assert "engine" in raised.value.message
    totals = wait_until(lambda: (t := held_totals(tenant_id=stack.ids["main"])).live_holds == 0 and t, timeout=30,
                        what="the hold released")  # fmt: skip
    assert totals.held_tokens == 0
    row = wait_until(lambda: UsageEvent.objects.filter(request_id=request_id).first(), timeout=60,
                     what="a usage row for the broken request")  # fmt: skip
    assert row.finish_reason == "error" and row.completion_tokens >= 1


def test_no_engine_left_is_a_503_and_holds_nothing(stack, lone_engine):
    process = lone_engine
    if process.poll() is None:
        process.kill()
    process.wait()  # engine-b dead (still listed healthy), engine-a disabled
    with pytest.raises(openai.InternalServerError) as raised:
        client(stack, stack.keys["main"]).chat.completions.create(
            model="support", messages=[{"role": "user", "content": "w3"}], max_tokens=2
        )
    assert raised.value.status_code == 503 and raised.value.code == "engine_unavailable"
    assert raised.value.response.headers["retry-after"] and raised.value.response.headers["x-ratelimit-limit-requests"]
    assert held_totals(tenant_id=stack.ids["main"]).live_holds == 0


def test_an_engine_gone_before_answering_is_retried_on_another(stack, lone_engine):
    process = lone_engine
    if process.poll() is None:
        process.kill()
    process.wait()
    engine_set("engine-a", enabled=True)  # engine-b is dead but still listed healthy: no health check ran
    time.sleep(SNAPSHOT_SECONDS)
    # engine-b, still listed as healthy, is some requests' first choice; each must be served by engine-a.
    for model in ("support", "shouty", BASE_MODEL, "support@1"):
        for gateway in (0, 1):
            api = client(stack, stack.keys["main"], gateway=gateway)
            completion = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "w3"}],
                                                     max_tokens=2)  # fmt: skip
            assert completion.choices[0].message.content is not None
