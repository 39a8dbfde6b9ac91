"""Engines that manage themselves, as real processes: started with the control plane's URL an engine is routed to
within a heartbeat; killed, it leaves routing within HEARTBEAT_MISSES intervals; SIGTERM under streaming load
finishes every stream; a rolling restart of two engines under load fails no request. The static engine-a is
disabled meanwhile, so every request goes to the self-registered ones."""

import signal
import threading
import time

import openai
import pytest

from gateway.models import Engine
from gateway.routing import routable_engines
from gateway.services import HEARTBEAT_MISSES
from metering.models import UsageEvent
from tests.gateway.conftest import client, engine_set, free_port, wait_for_engine, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

INTERVAL = 0.5  # heartbeat seconds
SNAPSHOT = 1.0  # each gateway process re-reads its engines once a second


def routed() -> set[str]:
    return set(routable_engines().values_list("name", flat=True))


@pytest.fixture(scope="module")
def fleet(stack, django_db_blocker):
    """Launches self-registering engines: fleet(name) -> process (relaunching a name reuses it)."""
    control_plane = stack.gateways[0].removesuffix("/v1")
    launched = []

    def launch(name: str, *extra: str):
        process = stack.launch_engine(name, free_port(), extra=(
            "--control-plane", control_plane, "--engine-name", name, "--heartbeat-interval", str(INTERVAL),
            "--leave-grace", "1.5", "--gpu-price-per-hour", "1.25", *extra,
        ))  # fmt: skip
        launched.append(process)
        return process

    with django_db_blocker.unblock():
        engine_set("engine-a", enabled=False)
    yield launch
    for process in launched:
        if process.poll() is None:
            process.kill()
            process.wait()
    with django_db_blocker.unblock():
        engine_set("engine-a", enabled=True)
        # the killed engines leave routing before the package's other tests send anything
        wait_until(lambda: not routed() & {"fleet-a", "fleet-b", "fleet-c", "fleet-p"}, timeout=HEARTBEAT_MISSES * INTERVAL + 5,
                   what="the fleet engines out of routing")  # fmt: skip
    time.sleep(SNAPSHOT)


def stream_one(stack, results: list, errors: list, max_tokens: int = 24, ids: list | None = None) -> None:
    api = client(stack, stack.keys["main"], gateway=len(results) % 2)
    try:
        stream = api.chat.completions.create(
            model="support", messages=[{"role": "user", "content": "w50 w51"}], max_tokens=max_tokens, stream=True,
            frequency_penalty=-2.0,
        )  # fmt: skip
        if ids is not None:
            ids.append(stream.response.headers["x-request-id"])
        finish = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        results.append(finish)
        if finish not in ("length", "stop"):
            errors.append(f"finish_reason {finish!r}")
    except openai.APIError as error:
        errors.append(repr(error))
        results.append(None)


class Load:
    """Streaming requests from `workers` threads, back to back, until stopped."""

    def __init__(self, stack, workers: int) -> None:
        self.stack, self.results, self.errors = stack, [], []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]

    def _run(self) -> None:
        while not self._stop.is_set():
            stream_one(self.stack, self.results, self.errors)

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)


def test_an_engine_joins_within_a_heartbeat_and_a_killed_one_leaves_in_time(stack, fleet):
    process = fleet("fleet-a")
    wait_for_engine(process)  # answering: it sent its first heartbeat as it started
    wait_until(lambda: "fleet-a" in routed(), timeout=INTERVAL + 1.0, what="fleet-a in routing")
    time.sleep(SNAPSHOT)
    answer = client(stack, stack.keys["main"]).chat.completions.create(
        model="support", messages=[{"role": "user", "content": "w3"}], max_tokens=2)
    assert answer.choices[0].message is not None  # served: fleet-a is the only engine

    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = time.monotonic()
    wait_until(lambda: "fleet-a" not in routed(), timeout=HEARTBEAT_MISSES * INTERVAL + 1.0,
               what="fleet-a out of routing")  # fmt: skip
    assert time.monotonic() - killed_at <= HEARTBEAT_MISSES * INTERVAL + 1.0


def test_an_engine_says_its_role_in_its_heartbeats(stack, fleet):
    process = fleet("fleet-p", "--role", "prefill")
    wait_for_engine(process)
    wait_until(lambda: "fleet-p" in routed(), timeout=INTERVAL + 1.0, what="fleet-p in routing")
    engine = Engine.objects.get(name="fleet-p")
    assert engine.role == "prefill" and engine.state["role"] == "prefill"
    process.send_signal(signal.SIGKILL)
    process.wait()
    wait_until(lambda: "fleet-p" not in routed(), timeout=HEARTBEAT_MISSES * INTERVAL + 1.0,
               what="fleet-p out of routing")  # fmt: skip


def test_sigterm_under_streaming_load_finishes_every_stream(stack, fleet):
    first, second = fleet("fleet-b"), fleet("fleet-c")
    for process in (first, second):
        wait_for_engine(process)
    wait_until(lambda: {"fleet-b", "fleet-c"} <= routed(), timeout=5, what="both engines in routing")
    time.sleep(SNAPSHOT)
    results, errors, ids = [], [], []
    threads = [threading.Thread(target=stream_one, args=(stack, results, errors, 48, ids)) for _ in range(6)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # the streams are running on both engines
    first.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(timeout=120)
    assert first.wait(timeout=60) in (0, -signal.SIGTERM)
    assert errors == [] and len(results) == 6, errors
    assert "fleet-b" not in routed()
    rows = wait_until(lambda: (r := list(UsageEvent.objects.filter(request_id__in=ids))) and len(r) == 6 and r,
                      timeout=60, what="usage rows of the 6 streams")  # fmt: skip
    drained = [row for row in rows if row.engine == "fleet-b"]
    assert drained, "no stream was running on the engine that was stopped"
    assert {row.finish_reason for row in drained} <= {"length", "stop"}


def test_rolling_restart_of_two_engines_under_load_fails_nothing(stack, fleet):
    for name in ("fleet-b", "fleet-c"):  # running since the test before, or started here
        process = stack.processes.get(name)
        if process is None or process.poll() is not None:
            wait_for_engine(fleet(name))
    wait_until(lambda: {"fleet-b", "fleet-c"} <= routed(), timeout=10, what="both engines in routing")
    time.sleep(SNAPSHOT)

    with Load(stack, workers=4) as load:
        for name in ("fleet-b", "fleet-c"):
            time.sleep(1.0)
            old = stack.processes[name]
            old.send_signal(signal.SIGTERM)
            assert old.wait(timeout=60) in (0, -signal.SIGTERM)
            new = fleet(name)
            wait_for_engine(new)
            wait_until(lambda n=name: n in routed(), timeout=5, what=f"{name} rejoined")
        time.sleep(1.0)
    assert load.errors == [], load.errors
    assert len(load.results) >= 8
