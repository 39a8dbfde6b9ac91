"""A stream ends when its text ends: the final chunk, the usage and [DONE] leave as soon as the engine's final event
arrives, and the durability work (the hold's settle in the admission store, the request log's row) runs after,
with what it guarantees: the usage recorded once, the hold released.

Each test makes a real store slow while the request is served, after its admission: Redis stopped (SIGSTOP, the
settle waits for its answer) or the request log's table locked in PostgreSQL (the row of a tenant that keeps bodies
waits for the lock). Where the stream's end waits for that store, the client reads nothing after its last text
until the store answers, and the reads here time out."""

import json
import signal
import threading
import time

import httpx
import pytest

from tests.gateway.conftest import free_port, launch_gateway, stop, wait_for_gateway, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

BODY = {"model": "tiny", "prompt": "w10 w11 w12", "max_tokens": 24, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}  # fmt: skip
END_WAIT = 10.0  # seconds the client waits for the stream's end while the store is held (the store waits longer)


@pytest.fixture
def gateway(stack, private_redis, tmp_path):
    """A gateway of the stack's whose admission store is `private_redis`, waited for as long as it takes."""
    port = free_port()
    env = stack.env | {"REDIS_URL": private_redis.url, "QUILT_REDIS_REPLY_TIMEOUT_SECONDS": "60"}
    process = launch_gateway(env, port, tmp_path / "gateway.log")
    try:
        wait_for_gateway(process)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop(process)


def read_stream(response: httpx.Response, *, on_first_text=None) -> list[dict | str]:
    """The stream's events (JSON objects, then "[DONE]"), read to the response's end."""
    events: list[dict | str] = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        events.append("[DONE]" if data == "[DONE]" else json.loads(data))
        if on_first_text is not None and len(events) == 1:
            on_first_text()
    return events


def test_the_stream_ends_while_the_admission_store_is_stalled(stack, private_redis, gateway):
    from django.test import override_settings

    from gateway.admission import held_totals
    from metering.models import UsageEvent

    headers = {"Authorization": f"Bearer {stack.keys['main']}"}
    stalled = threading.Event()

    def stall() -> None:  # admitted: the hold is in Redis; its settle comes at the answer's end
        private_redis.process.send_signal(signal.SIGSTOP)
        stalled.set()

    try:
        with httpx.stream("POST", f"{gateway}/completions", json=BODY, headers=headers,
                          timeout=httpx.Timeout(60, read=END_WAIT)) as response:  # fmt: skip
            assert response.status_code == 200
            request_id = response.headers["x-request-id"]
            events = read_stream(response, on_first_text=stall)  # a ReadTimeout where the end waits for Redis
        ended_stalled = stalled.is_set()
    finally:
        private_redis.process.send_signal(signal.SIGCONT)
    assert ended_stalled
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert [choice["finish_reason"] for choice in events[-3]["choices"]] in (["length"], ["stop"])
    with override_settings(REDIS_URL=private_redis.url):  # the stack's key prefix, this gateway's Redis
        totals = wait_until(lambda: (t := held_totals(tenant_id=stack.ids["main"])).live_holds == 0 and t,
                            timeout=30, what="the hold released")  # fmt: skip
    assert totals.held_tokens == 0
    row = wait_until(lambda: UsageEvent.objects.filter(request_id=request_id).first(), timeout=60,
                     what="the usage recorded")  # fmt: skip
    assert UsageEvent.objects.filter(request_id=request_id).count() == 1
    assert (row.prompt_tokens, row.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])


def test_a_tenant_at_its_concurrency_asks_again_while_the_request_log_is_locked(stack):
    # One request at a time, bodies kept: the first stream's end leaves while its row waits for the lock, and its
    # hold is released after; the second request, sent at once, waits for that settle rather than being refused.
    from django.db import connections

    from gateway.admission import held_totals
    from metering.models import RequestBody, UsageEvent

    url, headers = stack.gateways[0], {"Authorization": f"Bearer {stack.keys['kept']}"}
    locker = connections.create_connection("default")
    locker.inc_thread_sharing()  # released by a timer's thread
    locker.set_autocommit(False)
    released = threading.Event()

    def release() -> None:
        locker.rollback()
        locker.close()
        released.set()

    try:
        with locker.cursor() as cursor:
            cursor.execute("LOCK TABLE metering_requestbody IN SHARE MODE")  # inserts wait for it
        with httpx.stream("POST", f"{url}/completions", json=BODY, headers=headers,
                          timeout=httpx.Timeout(60, read=END_WAIT)) as response:  # fmt: skip
            assert response.status_code == 200
            first_id = response.headers["x-request-id"]
            first = read_stream(response)  # a ReadTimeout where the end waits for the row's lock
        assert first[-1] == "[DONE]" and not released.is_set()
        timer = threading.Timer(1.0, release)  # the second request is asked while the first still settles
        timer.start()
        asked = time.monotonic()
        second = httpx.post(f"{url}/completions", json=BODY, headers=headers, timeout=60)
        timer.join()
    finally:
        if not released.is_set():
            release()
    assert second.status_code == 200, second.text  # 429 (concurrency) when its admission did not wait
    assert second.text.rstrip().endswith("data: [DONE]")
    assert time.monotonic() - asked >= 0.9  # it was admitted once the first's settle had released its hold
    wait_until(lambda: RequestBody.objects.filter(request_id=first_id).exists(), timeout=30, what="the first's body kept")
    wait_until(lambda: held_totals(tenant_id=stack.ids["kept"]).live_holds == 0, timeout=30, what="both holds released")
    row = wait_until(lambda: UsageEvent.objects.filter(request_id=first_id).first(), timeout=60, what="usage recorded")
    assert UsageEvent.objects.filter(request_id=first_id).count() == 1
    assert row.completion_tokens == first[-2]["usage"]["completion_tokens"]
