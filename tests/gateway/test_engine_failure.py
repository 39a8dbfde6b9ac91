"""Engines failing: one killed mid-stream ends the client's stream with an error, releases the hold and leaves a
usage row of what was served; one that is gone before answering is retried on another."""

import json
import signal
import time

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

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


# the stream's last event when its engine breaks, as the client reads it: no [DONE] follows
ENGINE_ERROR_EVENT = b'data: {"error": {"message": "The engine failed while generating this response.", "type": "server_error", "param": null, "code": "engine_error"}}\n\n'  # fmt: skip


def test_engine_killed_mid_stream(stack, lone_engine):
    process = lone_engine
    api = client(stack, stack.keys["main"])
    with api.chat.completions.with_streaming_response.create(
        model="support", messages=[{"role": "user", "content": "w50 w51"}], max_tokens=200, stream=True,
        extra_body={"ignore_eos": True},  # the stream must still be running when the engine dies
    ) as response:  # fmt: skip
        request_id = response.headers["x-request-id"]
        received = b""
        for data in response.iter_bytes():
            if not received:
                process.send_signal(signal.SIGKILL)
            received += data
    assert received.endswith(ENGINE_ERROR_EVENT) and b"[DONE]" not in received
    served = received.removesuffix(ENGINE_ERROR_EVENT)
    assert served.startswith(b'data: {"id":"chatcmpl-' + request_id.encode()) and served.endswith(b"\n\n")
    chunks = [json.loads(event.removeprefix(b"data: ")) for event in served.split(b"\n\n")[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks)
    # the openai client reads those bytes as the text served, then the error
    stream = openai.Stream(cast_to=ChatCompletionChunk, client=api, response=httpx.Response(
        200, content=received, headers={"content-type": "text/event-stream"},
        request=httpx.Request("POST", f"{stack.gateways[0]}/chat/completions")))  # fmt: skip
    read = []
    with pytest.raises(openai.APIError) as raised:
        for chunk in stream:
            read.append(chunk)
    assert len(read) == len(chunks) and "engine" in raised.value.message
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
