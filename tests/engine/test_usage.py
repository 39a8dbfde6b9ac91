"""Usage events reach a real Redis broker; nothing is lost while it is down or across a crash."""

import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import msgspec
from kombu import Connection

from engine.contract import TASK_NAME, UsageEvent, usage_event_read
from engine.usage.emitter import UsageEmitter
from engine.usage.spool import UsageSpool
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SHARED_REDIS = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379").rstrip("/") + "/9"


def make_event(request_id: str, **changes) -> UsageEvent:
    fields = dict(
        request_id=request_id, tenant="acme", api_key_id="key-1", adapter_digest="ab" * 32,
        base_model="demo", prompt_tokens=12, cached_tokens=4, completion_tokens=7, gpu_ms=3.5,
        queue_ms=0.25, ttft_ms=8.0, e2e_ms=20.0, finish_reason="stop",
        finished_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
    )
    return UsageEvent(**{**fields, **changes})


def take_events(broker_url: str, queue_name: str, *, expected: int, timeout_s: float = 20.0) -> list[dict]:
    """Consume Celery task messages from the queue with kombu; return the events they carry."""
    events: list[dict] = []
    deadline = time.monotonic() + timeout_s
    with Connection(broker_url) as connection:
        inbox = connection.SimpleQueue(queue_name)
        while len(events) < expected and time.monotonic() < deadline:
            try:
                message = inbox.get(timeout=0.5)
            except inbox.Empty:
                continue
            assert message.headers["task"] == TASK_NAME
            args, kwargs, _ = message.payload
            assert kwargs == {}
            events.extend(args[0])
            message.ack()
        inbox.close()
    return events


def wait_for(condition, *, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def test_events_arrive_at_the_broker(tmp_path):
    queue_name = f"usage-test-{uuid.uuid4().hex}"
    emitter = UsageEmitter(broker_url=SHARED_REDIS, spool_path=tmp_path / "usage.jsonl",
                           batch_size=4, queue_name=queue_name).start()
    ids = [f"req-{i}" for i in range(10)]
    for request_id in ids:
        emitter.emit(make_event(request_id))
    emitter.close()
    events = take_events(SHARED_REDIS, queue_name, expected=len(ids))
    assert sorted(e["request_id"] for e in events) == sorted(ids)
    assert usage_event_read(events[0]) == make_event(events[0]["request_id"])
    assert emitter.spooled == 0
    assert not UsageSpool(tmp_path / "usage.jsonl").has_pending()


def test_broker_down_spools_then_delivers_after_restart(tmp_path, private_redis):
    queue_name = "usage"
    spool_path = tmp_path / "usage.jsonl"
    emitter = UsageEmitter(broker_url=private_redis.url, spool_path=spool_path, batch_size=4,
                           retry_interval_s=0.2, connect_timeout_s=0.5, queue_name=queue_name).start()
    emitter.emit(make_event("before-1"))
    assert [e["request_id"] for e in take_events(private_redis.url, queue_name, expected=1)] == ["before-1"]

    private_redis.stop()
    down_ids = [f"down-{i}" for i in range(6)]
    for request_id in down_ids:
        emitter.emit(make_event(request_id))
    wait_for(lambda: emitter.spooled == len(down_ids))
    assert UsageSpool(spool_path).pending_count() == len(down_ids)

    private_redis.start()
    emitter.emit(make_event("after-1"))
    events = take_events(private_redis.url, queue_name, expected=len(down_ids) + 1)
    emitter.close()
    assert sorted(e["request_id"] for e in events) == sorted([*down_ids, "after-1"])
    assert not UsageSpool(spool_path).has_pending()


CRASHING_PRODUCER = """
import sys, time
from datetime import UTC, datetime
from engine.usage.emitter import UsageEmitter
from engine.contract import UsageEvent
emitter = UsageEmitter(broker_url=sys.argv[1], spool_path=sys.argv[2], batch_size=3,
                       connect_timeout_s=0.5).start()
for i in range(7):
    emitter.emit(UsageEvent(request_id=f"crash-{i}", tenant="acme", api_key_id=None, adapter_digest=None,
                            base_model="demo", prompt_tokens=5, cached_tokens=0, completion_tokens=1,
                            gpu_ms=1.0, queue_ms=0.0, ttft_ms=1.0, e2e_ms=2.0, finish_reason="length",
                            finished_at=datetime.now(UTC)))
while emitter.spooled < 7:
    time.sleep(0.02)
print("spooled", flush=True)
time.sleep(60)
"""


def test_crash_after_spooling_loses_nothing(tmp_path, private_redis):
    spool_path = tmp_path / "usage.jsonl"
    dead_broker = f"redis://127.0.0.1:{free_port()}/0"
    producer = subprocess.Popen([sys.executable, "-c", CRASHING_PRODUCER, dead_broker, str(spool_path)],
                                cwd=REPO, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert producer.stdout.readline().strip() == "spooled"
    finally:
        producer.send_signal(signal.SIGKILL)
        producer.wait()
    with open(spool_path, "a") as spool:
        spool.write('{"request_id": "torn-wri')  # a write cut short by the crash

    restarted = UsageEmitter(broker_url=private_redis.url, spool_path=spool_path,
                             queue_name="usage").start()
    events = take_events(private_redis.url, "usage", expected=7)
    restarted.close()
    assert sorted(e["request_id"] for e in events) == [f"crash-{i}" for i in range(7)]
    assert not UsageSpool(spool_path).has_pending()


EMIT_THEN_DIE = """
import sys, time
from datetime import UTC, datetime
from engine.usage.emitter import UsageEmitter
from engine.contract import UsageEvent
# The broker is up, but the batch would only go out after a minute: every event is still in flight when killed.
emitter = UsageEmitter(broker_url=sys.argv[1], spool_path=sys.argv[2], batch_size=1000, flush_interval_s=60,
                       queue_name="usage").start()
for i in range(5):
    emitter.emit(UsageEvent(request_id=f"inflight-{i}", tenant="acme", api_key_id=None, adapter_digest=None,
                            base_model="demo", prompt_tokens=5, cached_tokens=0, completion_tokens=1,
                            gpu_ms=1.0, queue_ms=0.0, ttft_ms=1.0, e2e_ms=2.0, finish_reason="stop",
                            finished_at=datetime.now(UTC)))
print("emitted", flush=True)  # what the server does next: send the final event to the client
time.sleep(60)
"""


def test_kill_9_right_after_emit_returns_loses_nothing(tmp_path, private_redis):
    spool_path = tmp_path / "usage.jsonl"
    producer = subprocess.Popen([sys.executable, "-c", EMIT_THEN_DIE, private_redis.url, str(spool_path)],
                                cwd=REPO, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert producer.stdout.readline().strip() == "emitted"
    finally:
        producer.send_signal(signal.SIGKILL)
        producer.wait()
    assert take_events(private_redis.url, "usage", expected=1, timeout_s=0.5) == []  # nothing reached the broker
    restarted = UsageEmitter(broker_url=private_redis.url, spool_path=spool_path, queue_name="usage").start()
    events = take_events(private_redis.url, "usage", expected=5)
    restarted.close()
    assert sorted(e["request_id"] for e in events) == [f"inflight-{i}" for i in range(5)]
    assert not UsageSpool(spool_path).has_pending()
    assert spool_path.stat().st_size == 0  # all acknowledged: the log is truncated


def test_the_engine_gateway_contract_imports_without_torch_or_django():
    code = "import sys, engine.contract; bad = {'torch', 'django'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_a_busy_log_is_compacted_to_its_pending_events(tmp_path, monkeypatch):
    from engine.usage import spool as spool_module

    monkeypatch.setattr(spool_module, "COMPACT_BYTES", 2000)
    log = UsageSpool(tmp_path / "usage.jsonl")
    for i in range(40):  # always one event still pending, as on an engine that never drains to zero
        log.record(msgspec.to_builtins(make_event(f"busy-{i}")))
        if i:
            log.acknowledge([f"busy-{i - 1}"])
    assert (tmp_path / "usage.jsonl").stat().st_size < 2000 + 1000  # rewritten, not grown to 40 events
    reopened = UsageSpool(tmp_path / "usage.jsonl")
    assert [e["request_id"] for e in reopened.pending()] == ["busy-39"]
