"""Money under the failures an operator meets: a per-model price override, clients hanging up mid-stream, an
engine and a worker killed with `kill -9`. Real gateways, engine, worker, PostgreSQL and Redis; each test compares
usage rows with the requests served (0 lost, 0 duplicated) and spend with the budget (0 over)."""

import concurrent.futures
import json
import os
import signal
import threading
import time
import uuid
from datetime import UTC, datetime
from decimal import Decimal

import httpx
import msgspec
import pytest
from django.db.models import Sum

from engine import contract
from gateway.admission import held_totals
from gateway.selectors import admission_month_drift
from metering.models import UsageEvent
from tests.gateway.conftest import (
    BASE_MODEL,
    ENGINE_TOKEN,
    HANGUP_BUDGET,
    PRICED_LIMIT,
    free_port,
    wait_for_engine,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db]


def rows_for(request_ids) -> list[UsageEvent]:
    return list(UsageEvent.objects.filter(request_id__in=list(request_ids)))


def wait_for_rows(request_ids, *, timeout: float = 90) -> list[UsageEvent]:
    ids = set(request_ids)
    return wait_until(lambda: (rows := rows_for(ids)) and len(rows) == len(ids) and rows, timeout=timeout,
                      what=f"{len(ids)} usage rows")  # fmt: skip


def test_a_price_override_is_what_admission_holds_and_settles_so_the_spend_limit_holds(stack):
    def one(index: int) -> str | None:
        response = httpx.post(
            f"{stack.gateways[index % 2]}/completions", timeout=60,
            headers={"Authorization": f"Bearer {stack.keys['priced']}"},
            json={"model": BASE_MODEL, "prompt": "w10 w11", "max_tokens": 4},
        )  # fmt: skip
        if response.status_code == 429:
            assert response.json()["error"]["code"] in ("insufficient_quota", "rate_limit_exceeded")
            return None
        assert response.status_code == 200, response.text
        return response.headers["x-request-id"]

    served = []
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for _ in range(4):  # waves, so that settled usage (not only holds) decides later admissions
            served += [rid for rid in pool.map(one, range(8)) if rid is not None]
    assert served, "the override still leaves room for a few requests"
    rows = wait_for_rows(served)
    billed = sum((row.price for row in rows), Decimal(0))
    assert Decimal(0) < billed <= PRICED_LIMIT
    assert all(row.price_output_per_mtok == Decimal("400") for row in rows)  # the override, not the plan
    totals = wait_until(lambda: (t := held_totals(tenant_id=stack.ids["priced"])).provisional_tokens == 0 and t,
                        timeout=30, what="every settle final")  # fmt: skip
    assert totals.month_spend_picos == sum(row.price for row in rows) * 10**12  # exact: not rounded per request
    # Usage stops short of the limit (admission refuses the request that would pass it), yet the refusal itself
    # raises the 100% alert (the gateway tells billing; the worker records and sends it).
    from billing.models import BudgetAlert

    wait_until(lambda: BudgetAlert.objects.filter(tenant_id=stack.ids["priced"], kind="spend", threshold=100).exists(),
               timeout=60, what="the 100% spend alert")  # fmt: skip


def _hang_up(gateway: str, key: str) -> tuple[int, str | None]:
    """Opens a stream, reads its first chunk and hangs up; (status, request id)."""
    body = {"model": BASE_MODEL, "messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 64,
            "stream": True}  # fmt: skip
    with httpx.Client(timeout=60) as client, client.stream(
        "POST", f"{gateway}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, None
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break
        return 200, response.headers["x-request-id"]


def test_clients_hanging_up_mid_stream_never_take_the_tenant_past_its_budget(stack):
    key = stack.keys["hangup"]
    served, refused = [], 0
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        for _ in range(10):  # 100 hang-ups whose true usage together is well past the budget
            for status, request_id in pool.map(lambda i: _hang_up(stack.gateways[i % 2], key), range(10)):
                if status == 200:
                    served.append(request_id)
                else:
                    assert status == 429
                    refused += 1
            time.sleep(0.3)  # let some engine counts arrive, so final settles free room for later waves
    assert served and refused, "the budget admits some of these requests and refuses the rest"
    rows = wait_for_rows(served)
    used = sum(row.total_tokens for row in rows)
    assert used <= HANGUP_BUDGET  # the engine's counts, as billed
    assert all(row.prompt_tokens > 0 for row in rows)
    drift = wait_until(
        lambda: (d := admission_month_drift(tenant_id=stack.ids["hangup"])).provisional_tokens == 0
        and d.live_holds == 0 and d,
        timeout=30, what="every hang-up settled finally",
    )  # fmt: skip
    # Admission counts exactly what metering recorded: each provisional settle was replaced by the engine's.
    assert (drift.admission_tokens, drift.recorded_tokens, drift.drift_tokens) == (used, used, 0)
    assert drift.drift_spend == 0  # and their prices, to the last digit metering keeps (not rounded per request)


def _generate(engine_url: str, tenant_id: int, request_id: str) -> bool:
    """One request straight to the engine's API; True if the final event arrived (the request was served)."""
    body = {"request_id": request_id, "tenant": str(tenant_id), "prompt": "w5 w6 w7", "stream": True,
            "sampling": {"max_tokens": 6, "temperature": 0},
            "metadata": {"tenant_id": tenant_id, "model": BASE_MODEL, "engine": "engine-killed"}}  # fmt: skip
    try:
        with httpx.stream("POST", f"{engine_url}/v1/generate", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {ENGINE_TOKEN}"}) as response:  # fmt: skip
            for line in response.iter_lines():
                if line and json.loads(line).get("type") == "final":
                    return True
    except (httpx.HTTPError, json.JSONDecodeError):
        pass
    return False


def test_kill_9_of_an_engine_under_load_loses_no_usage(stack):
    port = free_port()
    engine = stack.launch_engine("engine-killed", port)
    wait_for_engine(engine)
    url, tenant_id = f"http://127.0.0.1:{port}", stack.ids["main"]
    served, stop = [], threading.Event()

    def client() -> None:
        while not stop.is_set():
            request_id = f"kill9-{uuid.uuid4().hex}"
            if _generate(url, tenant_id, request_id):
                served.append(request_id)

    threads = [threading.Thread(target=client) for _ in range(8)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(served) >= 40, timeout=120, what="40 requests served")
    engine.send_signal(signal.SIGKILL)  # under load: requests are finishing every few milliseconds
    engine.wait()
    stop.set()
    for thread in threads:
        thread.join()
    restarted = stack.launch_engine("engine-killed", free_port())  # the same usage spool
    wait_for_engine(restarted)
    rows = wait_for_rows(served)
    assert len(rows) == len(served) == len(set(served))
    assert UsageEvent.objects.filter(request_id__startswith="kill9-").count() <= len(served) + 8  # + the in-flight


def test_a_worker_killed_mid_ingest_has_its_batch_redelivered_within_a_minute(stack, settings):
    from django.db import connections

    from quilt.celery import app
    from tests.conftest import start_worker, stop_worker

    queue = f"quilt-test-kill-{uuid.uuid4().hex[:8]}"
    env = {"REDIS_URL": stack.env["REDIS_URL"], "QUILT_REDIS_KEY_PREFIX": stack.env["QUILT_REDIS_KEY_PREFIX"],
           "CELERY_TASK_DEFAULT_QUEUE": queue, "CELERY_VISIBILITY_TIMEOUT_SECONDS": "5"}  # fmt: skip
    settings.CELERY_TASK_DEFAULT_QUEUE = queue
    request_id = f"redeliver-{uuid.uuid4().hex}"
    event = msgspec.to_builtins(contract.UsageEvent(
        request_id=request_id, tenant=str(stack.ids["rival"]), api_key_id=None, adapter_digest=None,
        base_model=BASE_MODEL, prompt_tokens=5, cached_tokens=0, completion_tokens=3, gpu_ms=1.0, ttft_ms=1.0,
        e2e_ms=2.0, finish_reason="stop", finished_at=datetime.now(UTC),
    ))  # fmt: skip
    # Hold the lock the ingest needs (the tenant's month row), so that the worker is caught mid-ingest.
    blocker = connections.create_connection("default")
    blocker.connect()
    blocker.set_autocommit(True)
    with blocker.cursor() as cursor:
        cursor.execute(
            "INSERT INTO metering_usagemonth (tenant_id, month, requests, prompt_tokens, cached_tokens, "
            "completion_tokens, price, cost, uncosted_requests) VALUES (%s, date_trunc('month', now())::date, "
            "0, 0, 0, 0, 0, 0, 0) ON CONFLICT DO NOTHING", [stack.ids["rival"]],
        )  # fmt: skip
    blocker.set_autocommit(False)
    with blocker.cursor() as cursor:
        cursor.execute("SELECT 1 FROM metering_usagemonth WHERE tenant_id = %s FOR UPDATE", [stack.ids["rival"]])
    worker = start_worker(extra_env=env)
    try:
        app.send_task("metering.ingest_usage", args=[[event]], queue=queue)
        wait_until(lambda: _waiting_on_locks() > 0, timeout=60, what="the worker waiting mid-ingest")
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
    finally:
        blocker.rollback()
        blocker.close()
    killed_at = time.monotonic()
    worker = start_worker(extra_env=env)
    try:
        wait_until(lambda: rows_for([request_id]), timeout=60, what="the batch redelivered and ingested")
    finally:
        stop_worker(worker)
    assert time.monotonic() - killed_at < 60
    assert UsageEvent.objects.filter(request_id=request_id).count() == 1
    assert UsageEvent.objects.filter(tenant_id=stack.ids["rival"]).aggregate(n=Sum("completion_tokens"))["n"] >= 3


def _waiting_on_locks() -> int:
    from django.db import connections

    probe = connections.create_connection("default")
    try:
        with probe.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                           "AND datname = current_database()")  # fmt: skip
            return cursor.fetchone()[0]
    finally:
        probe.close()


def test_the_production_visibility_timeout_redelivers_within_a_minute():
    from quilt.settings import base

    options = base.REDIS_BROKER_TRANSPORT_OPTIONS
    assert options["visibility_timeout"] + options["unacked_restore_interval"] <= 60
    assert base.CELERY_TASK_ACKS_LATE and base.CELERY_TASK_REJECT_ON_WORKER_LOST
