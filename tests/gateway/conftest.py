"""The whole path as real processes: two gateways under uvicorn, an engine on a tiny random Llama with PEFT
adapters, a Celery worker, PostgreSQL and Redis. Built once for the package with its rows committed. Tests here
are plain `django_db` tests (they see what the processes commit) and never `transaction=True` ones, whose flush
would pull the rows out from under the running processes; a test that must commit a change runs a management
command in a subprocess (`manage`). Everything is flushed when the package is done."""

import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, start_worker, stop_worker, test_database_url
from tests.ports import free_port

ENGINE_TOKEN = "gateway-tests-engine-token"
METRICS_TOKEN = "gateway-tests-metrics-token"
BASE_MODEL = "tiny"
# A budget request: prompt "w10 w11" held as 7 bytes + 16 template tokens, plus max_tokens 4. The budget fits 20.
BUDGET_HOLD = 7 + 16 + 4
BUDGET_TOKENS = 20 * BUDGET_HOLD
KEY_BUDGET = Decimal("0.02")  # the keyed tenant's capped key: about ten short requests at its plan's prices
PRICED_LIMIT = Decimal("0.01")  # gw-priced's monthly spend limit
HANGUP_BUDGET = 1000  # gw-hangup's monthly token budget: holds of 104 tokens, at most 9 at once
ROTATING_BUDGET = Decimal("0.005")  # keyed-rotating's budget: two short requests at the keyed plan's prices
EXACT_KEY_BUDGET = Decimal("0.01")  # gw-exact's key, of which this month's record already holds EXACT_KEY_SPENT
EXACT_KEY_SPENT = Decimal("0.00996")  # 2,400 prompt and 16,000 completion tokens: 19 requests of 2.1 micro-dollars left
KEY_TPM = 120  # keyed-tpm's own tokens per minute


def wait_until(check, *, timeout: float, what: str, process: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {process.returncode}")
        result = check()
        if result:
            return result
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not happen within {timeout} s")


def _answers(url: str, ok_statuses: tuple[int, ...]) -> bool:
    try:
        return httpx.get(url, timeout=1.0, headers={"Authorization": f"Bearer {ENGINE_TOKEN}"}).status_code in ok_statuses
    except httpx.HTTPError:
        return False


@dataclass
class Stack:
    gateways: list[str]  # base URLs of the two gateway processes, e.g. http://127.0.0.1:PORT/v1
    engine_url: str
    model_dir: Path
    adapter_dirs: dict[str, Path]
    env: dict
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)  # name -> plaintext
    ids: dict[str, object] = field(default_factory=dict)

    def launch_engine(self, name: str, port: int, extra: tuple[str, ...] = ()) -> subprocess.Popen:
        adapter_store = Path(self.env["MEDIA_ROOT"]) / "adapters"
        command = [
            sys.executable, "-m", "engine", "--model", str(self.model_dir), "--port", str(port),
            "--adapter-store", str(adapter_store), "--served-model-name", BASE_MODEL,
            "--usage-queue", self.env["CELERY_TASK_DEFAULT_QUEUE"], "--broker-url", self.env["CELERY_BROKER_URL"],
            "--usage-spool", str(Path(self.env["MEDIA_ROOT"]) / f"spool-{name}.jsonl"), "--log-level", "warning", *extra,
        ]  # fmt: skip
        log = open(Path(self.env["MEDIA_ROOT"]) / f"{name}.log", "a")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(command, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        process.health_url = f"http://127.0.0.1:{port}/v1/health"
        self.processes[name] = process
        return process


def wait_for_engine(process: subprocess.Popen) -> None:
    wait_until(lambda: _answers(process.health_url, (200,)), timeout=180, what="engine answering", process=process)


def launch_gateway(env: dict, port: int, log_path: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "uvicorn", "gateway.asgi:application", "--app-dir", str(REPO / "platform"),
        "--http", "httptools", "--loop", "uvloop", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--no-access-log",
    ]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    process.models_url = f"http://127.0.0.1:{port}/v1/models"
    return process


def process_env(*, redis_url: str, prefix: str, media: Path, **extra: str) -> dict:
    """The environment of a stack's gateway, engine and worker processes: this run's database, Redis key prefix,
    Celery queue and media, with `extra` variables on top."""
    from django.conf import settings

    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "quilt.settings.test",
        "DATABASE_URL": test_database_url(),
        "REDIS_URL": redis_url,
        "QUILT_REDIS_KEY_PREFIX": prefix,
        "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
        "CELERY_TASK_DEFAULT_QUEUE": settings.CELERY_TASK_DEFAULT_QUEUE,
        "MEDIA_ROOT": str(media),
        "QUILT_ENGINE_TOKEN": ENGINE_TOKEN,
        "PYTHONPATH": f"{REPO}:{REPO / 'platform'}",
        "LOG_LEVEL": "WARNING",
        **extra,
    }


def launch_demo_engine(*, model_dir: Path, served_name: str, media: Path, env: dict, port: int) -> subprocess.Popen:
    """`python -m engine` on a model directory, its adapters stored and its usage spooled under `media`."""
    command = [
        sys.executable, "-m", "engine", "--model", str(model_dir), "--port", str(port),
        "--adapter-store", str(media / "adapters"), "--served-model-name", served_name,
        "--usage-queue", env["CELERY_TASK_DEFAULT_QUEUE"], "--broker-url", env["CELERY_BROKER_URL"],
        "--usage-spool", str(media / "spool-engine.jsonl"), "--log-level", "warning",
    ]  # fmt: skip
    log = open(media / "engine.log", "w")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    process.health_url = f"http://127.0.0.1:{port}/v1/health"
    return process


@dataclass
class SingleEngineStack:
    """What `single_engine_stack` started, and the rows its seed made."""

    gateway: str  # http://127.0.0.1:PORT/v1
    model_dir: Path
    media: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    ids: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def single_engine_stack(processes: dict, *, model_dir: Path, served_name: str, media: Path, django_db_blocker,
                        seed: Callable[[], None], **env_extra: str) -> Iterator[str]:
    """One engine on `model_dir` serving `served_name`, one gateway under uvicorn and a Celery worker, on this
    run's database, its own Redis key prefix and `media`; `seed()` commits the rows (the base model, tenants, keys)
    as they start. Yields the gateway's base URL (http://127.0.0.1:PORT/v1); everything is torn down after.
    `env_extra`: settings for the processes' environment."""
    from django.test import override_settings

    from gateway.models import Engine

    others: list[int] = []
    redis_url = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379") + "/13"
    prefix = f"quilt-{served_name}-{uuid.uuid4().hex[:10]}"
    overrides = override_settings(REDIS_URL=redis_url, QUILT_REDIS_KEY_PREFIX=prefix, MEDIA_ROOT=media,
                                  QUILT_ENGINE_TOKEN=ENGINE_TOKEN)  # fmt: skip
    overrides.enable()
    env = process_env(redis_url=redis_url, prefix=prefix, media=media, **env_extra)
    engine_port, gateway_port = free_port(), free_port()
    worker = None
    try:
        engine = processes["engine"] = launch_demo_engine(
            model_dir=model_dir, served_name=served_name, media=media, env=env, port=engine_port
        )
        gateway = processes["gateway"] = launch_gateway(env, gateway_port, media / "gateway.log")
        with django_db_blocker.unblock():
            seed()
        worker = start_worker(extra_env={"REDIS_URL": redis_url, "QUILT_REDIS_KEY_PREFIX": prefix,
                                         "MEDIA_ROOT": str(media), "QUILT_ENGINE_TOKEN": ENGINE_TOKEN})  # fmt: skip
        drain(worker, media / "worker.log")
        wait_for_engine(engine)
        wait_for_gateway(gateway)
        with django_db_blocker.unblock():
            # the gateway routes to every enabled engine: another stack's, still up, must not take this one's requests
            others = list(Engine.objects.filter(enabled=True).values_list("pk", flat=True))
            Engine.objects.filter(pk__in=others).update(enabled=False)
            register_engine(f"engine-{served_name}", f"http://127.0.0.1:{engine_port}")
        yield f"http://127.0.0.1:{gateway_port}/v1"
    finally:
        with django_db_blocker.unblock():
            Engine.objects.filter(pk__in=others).update(enabled=True)
        tear_down_stack(processes, worker, redis_url=redis_url, prefix=prefix, django_db_blocker=django_db_blocker,
                        overrides=overrides)


def wait_for_gateway(process: subprocess.Popen) -> None:
    wait_until(lambda: _answers(process.models_url, (401,)), timeout=180, what="gateway answering", process=process)


def drain(process: subprocess.Popen, path: Path) -> None:
    """Copies a piped process's output to a file, so that a full pipe never blocks it."""

    def copy() -> None:
        with open(path, "w") as log:
            for line in process.stdout:
                log.write(line)
                log.flush()

    threading.Thread(target=copy, daemon=True).start()


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _seed(stack: Stack) -> None:
    from django.core.management import call_command

    from apikeys.models import Scope
    from metering.models import ModelPrice
    from tenancy.models import Plan
    from tests.platform.factories import TenantFactory, make_key

    call_command("registerbasemodel", BASE_MODEL, str(stack.model_dir), verbosity=0)
    roomy = Plan.objects.create(
        slug="gw-roomy", name="Roomy", requests_per_minute=10_000, tokens_per_minute=10_000_000,
        max_concurrent_requests=500, price_input_per_mtok=Decimal("1.5"), price_output_per_mtok=Decimal("6"),
        price_cached_input_per_mtok=Decimal("0.5"), default_max_tokens=16,
    )  # fmt: skip
    main = TenantFactory(slug="gw-main", plan=roomy)
    rival = TenantFactory(slug="gw-rival", plan=roomy)
    budget = TenantFactory(slug="gw-budget", plan=Plan.objects.create(
        slug="gw-budget", name="Budget", requests_per_minute=10_000, tokens_per_minute=10_000_000,
        max_concurrent_requests=1000, monthly_token_budget=BUDGET_TOKENS,
    ))  # fmt: skip
    broke = TenantFactory(slug="gw-broke", plan=Plan.objects.create(
        slug="gw-broke", name="Broke", monthly_token_budget=0, monthly_spend_limit=Decimal("0.01"),
    ))  # fmt: skip
    # Plan prices that would admit hundreds of requests, and an override for the served model that fits a few.
    priced_plan = Plan.objects.create(
        slug="gw-priced", name="Priced", requests_per_minute=10_000, tokens_per_minute=10_000_000,
        max_concurrent_requests=1000, monthly_spend_limit=PRICED_LIMIT, price_input_per_mtok=Decimal("1"),
        price_cached_input_per_mtok=Decimal("1"), price_output_per_mtok=Decimal("1"),
    )  # fmt: skip
    ModelPrice.objects.create(plan=priced_plan, base_model=BASE_MODEL, price_input_per_mtok=Decimal("100"),
                              price_cached_input_per_mtok=Decimal("100"), price_output_per_mtok=Decimal("400"))  # fmt: skip
    priced = TenantFactory(slug="gw-priced", plan=priced_plan)
    hangup = TenantFactory(slug="gw-hangup", plan=Plan.objects.create(
        slug="gw-hangup", name="Hang-up", requests_per_minute=10_000, tokens_per_minute=10_000_000,
        max_concurrent_requests=1000, monthly_token_budget=HANGUP_BUDGET,
    ))  # fmt: skip
    # Two keys of one tenant: one with its own monthly budget (a few requests' worth at these prices), one without.
    keyed_plan = Plan.objects.create(
        slug="gw-keyed", name="Keyed", requests_per_minute=10_000, tokens_per_minute=10_000_000,
        max_concurrent_requests=1000, price_input_per_mtok=Decimal("100"), price_cached_input_per_mtok=Decimal("100"),
        price_output_per_mtok=Decimal("400"),
    )  # fmt: skip
    keyed = TenantFactory(slug="gw-keyed", plan=keyed_plan)
    # Prices that make each request's price a fraction of a micro-dollar off a whole one (2 prompt tokens and 3
    # completion tokens: 2.1 micro-dollars).
    exact = TenantFactory(slug="gw-exact", plan=Plan.objects.create(
        slug="gw-exact", name="Exact", requests_per_minute=10_000, tokens_per_minute=10_000_000,
        max_concurrent_requests=1000, price_input_per_mtok=Decimal("0.15"), price_cached_input_per_mtok=Decimal("0.05"),
        price_output_per_mtok=Decimal("0.6"),
    ))  # fmt: skip
    busy = TenantFactory(slug="gw-busy", plan=Plan.objects.create(  # admitted from leases (test_admission_leases)
        slug="gw-busy", name="Busy", requests_per_minute=100_000, tokens_per_minute=100_000_000,
        max_concurrent_requests=1000, monthly_token_budget=10**9, monthly_spend_limit=Decimal("1000"),
        price_input_per_mtok=Decimal("0.15"), price_cached_input_per_mtok=Decimal("0.05"),
        price_output_per_mtok=Decimal("0.6"),
    ))  # fmt: skip
    # One request at a time, its bodies kept in the request log (test_stream_end)
    kept = TenantFactory(slug="gw-kept", request_body_retention_days=7, plan=Plan.objects.create(
        slug="gw-kept", name="Kept", requests_per_minute=10_000, tokens_per_minute=10_000_000,
        max_concurrent_requests=1,
    ))  # fmt: skip
    for name, tenant in (("main", main), ("rival", rival), ("budget", budget), ("broke", broke), ("priced", priced),
                         ("hangup", hangup), ("keyed", keyed), ("exact", exact), ("busy", busy),
                         ("kept", kept)):  # fmt: skip
        stack.ids[name] = tenant.pk
    for tenant, adapter, path in ((main, "support", "a"), (main, "shouty", "b"), (rival, "secret", "a"),
                                  (rival, "fragile", "c")):  # fmt: skip
        call_command("importadapter", tenant.slug, adapter, str(stack.adapter_dirs[path]), verbosity=0)
    for name, tenant, scopes, extra in (
        ("main", main, [Scope.INFERENCE], {}),
        ("main-admin", main, [Scope.ADMIN], {}),
        ("main-limited", main, [Scope.INFERENCE], {"allowed_models": ["support"]}),
        ("main-revocable", main, [Scope.INFERENCE], {}),
        ("rival", rival, [Scope.INFERENCE], {}),
        ("budget", budget, [Scope.INFERENCE], {}),
        ("broke", broke, [Scope.INFERENCE], {}),
        ("broke-reader", broke, [Scope.USAGE_READ], {}),
        ("priced", priced, [Scope.INFERENCE], {}),
        ("hangup", hangup, [Scope.INFERENCE], {}),
        ("keyed-capped", keyed, [Scope.INFERENCE], {"monthly_spend_limit": KEY_BUDGET}),
        ("keyed-sibling", keyed, [Scope.INFERENCE], {}),
        ("keyed-admin", keyed, [Scope.ADMIN], {}),
        ("keyed-rotating", keyed, [Scope.INFERENCE], {"monthly_spend_limit": ROTATING_BUDGET}),
        ("keyed-rpm", keyed, [Scope.INFERENCE], {"requests_per_minute": 2}),
        ("keyed-tpm", keyed, [Scope.INFERENCE], {"tokens_per_minute": KEY_TPM}),
        ("exact", exact, [Scope.INFERENCE], {"monthly_spend_limit": EXACT_KEY_BUDGET}),
        ("busy", busy, [Scope.INFERENCE], {"monthly_spend_limit": Decimal("100")}),
        ("kept", kept, [Scope.INFERENCE], {}),
    ):
        key, plaintext = make_key(tenant, scopes=scopes, name=name, **extra)
        stack.keys[name], stack.ids[f"key-{name}"] = plaintext, key.prefix
        if name == "exact":  # what the key spent earlier this month, as metering recorded it
            from datetime import UTC, datetime

            from metering.services import usage_ingest
            from tests.metering.usage import usage_event

            usage_ingest(events=[usage_event(exact, api_key_id=key.pk, finished_at=datetime.now(UTC), prompt_tokens=2400,
                                             cached_tokens=0, completion_tokens=16000)])  # fmt: skip


def register_engine(name: str, url: str) -> None:
    from gateway.services import engine_register
    from tenancy.audit import Actor

    engine = engine_register(actor=Actor.system(), name=name, url=url, gpu_price_per_hour=Decimal("2.5"))
    assert engine.healthy, engine.last_error


@pytest.fixture(scope="package")
def stack(django_db_setup, django_db_blocker, tmp_path_factory):
    from django.test import override_settings

    from tests.engine.conftest import build_adapter, build_checkpoint

    root = tmp_path_factory.mktemp("gateway-stack")
    model_dir = build_checkpoint(root / "model", "llama", seed=11)
    adapter_dirs = {
        "a": build_adapter(model_dir, root / "adapter-a", seed=12, r=4, targets=["q_proj", "v_proj"]),
        "b": build_adapter(model_dir, root / "adapter-b", seed=13, r=8, targets=["o_proj", "down_proj"]),
        "c": build_adapter(model_dir, root / "adapter-c", seed=14, r=4, targets=["k_proj", "up_proj"]),
    }
    redis_url = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379") + "/13"
    prefix = f"quilt-test-{uuid.uuid4().hex[:10]}"
    media = root / "media"
    media.mkdir()
    overrides = override_settings(
        REDIS_URL=redis_url, QUILT_REDIS_KEY_PREFIX=prefix, MEDIA_ROOT=media, QUILT_ENGINE_TOKEN=ENGINE_TOKEN
    )
    overrides.enable()
    env = process_env(redis_url=redis_url, prefix=prefix, media=media, QUILT_METRICS_TOKEN=METRICS_TOKEN,
                      QUILT_PREFILL_HOP_MIN_UNCACHED_TOKENS="32",  # a fleet with roles: the tiny model's context is 256
                      QUILT_PREFILL_HOP_TIMEOUT_SECONDS="3", QUILT_KV_LEASE_TTL_SECONDS="5")  # fmt: skip
    engine_port = free_port()
    stack = Stack(gateways=[], engine_url=f"http://127.0.0.1:{engine_port}", model_dir=model_dir,
                  adapter_dirs=adapter_dirs, env=env)  # fmt: skip
    worker = None
    try:
        # Everything starts at once: on a busy 2-core machine each process takes seconds to import.
        engine = stack.launch_engine("engine-a", engine_port)
        for name in ("gateway-1", "gateway-2"):
            port = free_port()
            stack.processes[name] = launch_gateway(env, port, media / f"{name}.log")
            stack.gateways.append(f"http://127.0.0.1:{port}/v1")
        with django_db_blocker.unblock():
            _seed(stack)
        worker = start_worker(extra_env={"REDIS_URL": redis_url, "QUILT_REDIS_KEY_PREFIX": prefix,
                                         "MEDIA_ROOT": str(media), "QUILT_ENGINE_TOKEN": ENGINE_TOKEN,
                                         "QUILT_UNREPORTED_USAGE_GRACE_SECONDS": "2"})  # fmt: skip
        drain(worker, media / "worker.log")
        wait_for_engine(engine)
        for name in ("gateway-1", "gateway-2"):
            wait_for_gateway(stack.processes[name])
        with django_db_blocker.unblock():
            register_engine("engine-a", stack.engine_url)
        yield stack
    finally:
        tear_down_stack(stack.processes, worker, redis_url=redis_url, prefix=prefix,
                        django_db_blocker=django_db_blocker, overrides=overrides)


def tear_down_stack(processes: dict, worker, *, redis_url: str, prefix: str, django_db_blocker, overrides) -> None:
    """What every process-stack fixture does last: stop its processes and Celery worker (if any), drop its Redis keys,
    empty the database and put the settings back."""
    from django.core.management import call_command

    for process in processes.values():
        stop(process)
    if worker is not None:
        stop_worker(worker)
    _forget_redis(redis_url, prefix)
    with django_db_blocker.unblock():
        call_command("flush", interactive=False, verbosity=0)
    overrides.disable()


def _forget_redis(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    with contextlib.suppress(redis.RedisError):
        for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            client.delete(key)


def engine_set(name: str, *, enabled: bool) -> None:
    """Commits a change to an engine from inside a test (whose own transaction the processes can't see)."""
    from django.db import connections

    connection = connections.create_connection("default")
    try:
        with connection.cursor() as cursor:
            cursor.execute("UPDATE gateway_engine SET enabled = %s WHERE name = %s", [enabled, name])
    finally:
        connection.close()


def client(stack: Stack, key: str, *, gateway: int = 0, **options):
    import openai

    return openai.OpenAI(base_url=stack.gateways[gateway], api_key=key, max_retries=0, timeout=60, **options)


# Admission's rules, the same for both backends (test_admission*.py).
@pytest.fixture(params=["database", "redis"])
def backend(request):
    from django.test import override_settings

    if request.param == "database":
        with override_settings(REDIS_URL=""):
            yield request.param
        return
    url = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379") + "/13"
    prefix = f"quilt-admission-test-{uuid.uuid4().hex[:8]}"
    with override_settings(REDIS_URL=url, QUILT_REDIS_KEY_PREFIX=prefix):
        yield request.param
    import redis

    client = redis.Redis.from_url(url)
    for key in client.scan_iter(match=f"{prefix}:*"):
        client.delete(key)


@pytest.fixture
def tenant():
    from tests.platform.factories import TenantFactory

    return TenantFactory()
