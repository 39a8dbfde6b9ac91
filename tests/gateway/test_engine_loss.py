"""Nothing a client was served goes unbilled, whatever happens to its engine: an engine SIGKILLed under streaming
load through the gateways, whose spool (an emptyDir in Kubernetes) goes with it and whose name never comes back.
Real gateways, engine, Celery worker and broker, PostgreSQL and Redis."""

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from metering.models import UsageEvent
from tests.gateway.conftest import BASE_MODEL, free_port, register_engine, wait_for_engine, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

SNAPSHOT_SECONDS = 1.1  # each gateway re-reads the engine list once a second


@pytest.fixture(scope="module", params=["broker-up", "broker-unreachable"])  # module: its rows are committed
def doomed_engine(request, stack, django_db_blocker):
    """An engine that takes all the traffic (engine-a disabled meanwhile) until it is killed for good: one whose
    broker takes its events a fraction of a second after each request ends (those of the last moment are lost with
    it), and one cut off from its broker (all of them are)."""
    from gateway.models import Engine

    port = free_port()
    extra = ("--broker-url", f"redis://127.0.0.1:{free_port()}/0") if request.param == "broker-unreachable" else ()
    process = stack.launch_engine("engine-doomed", port, extra)
    wait_for_engine(process)
    with django_db_blocker.unblock():
        register_engine("engine-doomed", f"http://127.0.0.1:{port}")
        Engine.objects.filter(name="engine-a").update(enabled=False)
    time.sleep(SNAPSHOT_SECONDS)
    yield process
    if process.poll() is None:
        process.kill()
    with django_db_blocker.unblock():
        Engine.objects.filter(name="engine-doomed").delete()
        Engine.objects.filter(name="engine-a").update(enabled=True)
    time.sleep(SNAPSHOT_SECONDS)


def _stream(gateway: str, key: str) -> tuple[str, dict] | None:
    """One streamed chat; (request id, the usage it reported) if the client got the whole answer, else None."""
    body = {"model": BASE_MODEL, "messages": [{"role": "user", "content": "w30 w31 w32"}], "max_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    usage, done = None, False
    try:
        with httpx.stream("POST", f"{gateway}/chat/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {key}"}) as response:  # fmt: skip
            if response.status_code != 200:
                return None
            for line in response.iter_lines():
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                elif data.startswith("{") and json.loads(data).get("usage"):
                    usage = json.loads(data)["usage"]
            request_id = response.headers["x-request-id"]
    except httpx.HTTPError:
        return None
    return (request_id, usage) if done and usage else None


def test_requests_served_just_before_their_engine_is_killed_for_good_are_billed(stack, doomed_engine):
    from django.conf import settings

    from quilt.celery import app

    served: dict[str, dict] = {}
    stop = threading.Event()

    def client(index: int) -> None:
        while not stop.is_set():
            result = _stream(stack.gateways[index % 2], stack.keys["main"])
            if result is not None:
                served[result[0]] = result[1]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(served) >= 20, timeout=120, what="20 streams served")
    doomed_engine.send_signal(signal.SIGKILL)  # requests finish every few milliseconds: some events are still queued
    doomed_engine.wait()
    stop.set()
    for thread in threads:
        thread.join()
    Path(stack.env["MEDIA_ROOT"], "spool-engine-doomed.jsonl").unlink(missing_ok=True)  # its emptyDir is gone too
    time.sleep(2.5)  # the grace the stack's worker gives an engine's own event (QUILT_UNREPORTED_USAGE_GRACE_SECONDS)

    def billed() -> list[UsageEvent] | None:
        app.send_task("gateway.bill_unreported_usage", queue=settings.CELERY_TASK_DEFAULT_QUEUE)
        rows = list(UsageEvent.objects.filter(request_id__in=list(served)))
        return rows if len(rows) == len(served) else time.sleep(1)

    rows = wait_until(billed, timeout=60, what=f"all {len(served)} served requests billed")
    for row in rows:  # billed for what the client was told it used
        usage = served[row.request_id]
        assert (row.prompt_tokens, row.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert row.price > 0
