"""Fine-tuning as real processes: a gateway under uvicorn, an engine on the demo model (`python -m engine`), a
Celery worker on a training queue of this run's own, PostgreSQL and Redis. Built once for the package with its
rows committed (tests are plain `django_db` tests that see what the processes commit, as in tests/gateway);
everything is flushed when the package is done. The training worker can be killed and started again."""

import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.gateway.conftest import (
    ENGINE_TOKEN,
    drain,
    free_port,
    launch_demo_engine,
    launch_gateway,
    process_env,
    register_engine,
    tear_down_stack,
    wait_for_engine,
    wait_for_gateway,
)

BASE_MODEL = "demo"
LEASE_SECONDS = 3  # a trainer silent this long counts as dead when the stale-job sweep runs
CHECKPOINT_STEPS = 5
TRAINING_PRICE = Decimal("4.00")  # per million training tokens
SLOW_RPM = 3  # tenant "slow": the Files and Fine-tuning APIs count against its requests per minute
CRAMPED_STORAGE_BYTES = 3000  # tenant "cramped": its plan stores this many bytes of fine-tuning files


@dataclass
class FineTuningStack:
    gateway: str  # http://127.0.0.1:PORT/v1
    model_dir: Path
    env: dict
    training_queue: str
    media: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    ids: dict[str, int] = field(default_factory=dict)

    def start_trainer(self) -> subprocess.Popen:
        """A worker on the training queue alone; returns once it says it is ready."""
        command = [
            sys.executable, "-m", "celery", "--workdir", str(REPO / "platform"), "-A", "quilt", "worker",
            "--loglevel", "INFO", "--pool", "solo", "--without-gossip", "--without-mingle", "--without-heartbeat",
            "-Q", self.training_queue, "-n", f"trainer-{uuid.uuid4().hex[:6]}@%h",
        ]  # fmt: skip
        worker = subprocess.Popen(command, cwd=REPO, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)  # fmt: skip
        deadline, seen = time.monotonic() + 120, []
        while time.monotonic() < deadline:
            line = worker.stdout.readline()
            if not line and worker.poll() is not None:
                break
            seen.append(line)
            if " ready." in line:
                drain(worker, self.media / f"trainer-{worker.pid}.log")
                self.processes["trainer"] = worker
                return worker
        worker.kill()
        raise RuntimeError("the training worker did not start:\n" + "".join(seen[-40:]))


def _seed(stack: FineTuningStack) -> None:
    from django.core.management import call_command

    from apikeys.models import Scope
    from tenancy.models import Plan
    from tests.platform.factories import TenantFactory, make_key

    call_command("registerbasemodel", BASE_MODEL, str(stack.model_dir), verbosity=0)
    plan = Plan.objects.create(
        slug="ft-plan", name="Tuner", requests_per_minute=10_000, tokens_per_minute=10_000_000,
        max_concurrent_requests=500, default_max_tokens=16, max_concurrent_fine_tuning_jobs=1,
        price_training_per_mtok=TRAINING_PRICE,
    )  # fmt: skip
    slow = Plan.objects.create(
        slug="ft-slow", name="Slow", requests_per_minute=SLOW_RPM, tokens_per_minute=10_000_000,
        max_concurrent_requests=5, default_max_tokens=16,
    )  # fmt: skip
    cramped = Plan.objects.create(
        slug="ft-cramped", name="Cramped", requests_per_minute=10_000, tokens_per_minute=10_000_000,
        max_concurrent_requests=5, max_file_storage_bytes=CRAMPED_STORAGE_BYTES,
    )  # fmt: skip
    plans = {"slow": slow, "cramped": cramped}
    for name in ("main", "rival", "cancel", "kill", "slow", "cramped", "audit"):
        tenant = TenantFactory(slug=f"ft-{name}", plan=plans.get(name, plan))
        key, plaintext = make_key(tenant, scopes=[Scope.INFERENCE], name=name)
        stack.ids[name], stack.keys[name] = tenant.pk, plaintext


@pytest.fixture(scope="package")
def ft_stack(django_db_setup, django_db_blocker, tmp_path_factory):
    from django.conf import settings
    from django.test import override_settings

    from engine.demo.builder import ensure_demo

    model_dir = ensure_demo(REPO / "var" / "demo-model")
    media = tmp_path_factory.mktemp("finetuning-stack")
    redis_url = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379") + "/13"
    prefix = f"quilt-ft-{uuid.uuid4().hex[:10]}"
    training_queue = f"{settings.CELERY_TASK_DEFAULT_QUEUE}-training"
    overrides = override_settings(
        REDIS_URL=redis_url, QUILT_REDIS_KEY_PREFIX=prefix, MEDIA_ROOT=media, QUILT_ENGINE_TOKEN=ENGINE_TOKEN,
        QUILT_TRAINING_QUEUE=training_queue, QUILT_FINE_TUNING_LEASE_SECONDS=LEASE_SECONDS,
    )  # fmt: skip
    overrides.enable()
    env = process_env(
        redis_url=redis_url, prefix=prefix, media=media, QUILT_TRAINING_QUEUE=training_queue,
        QUILT_FINE_TUNING_LEASE_SECONDS=str(LEASE_SECONDS), QUILT_FINE_TUNING_CHECKPOINT_STEPS=str(CHECKPOINT_STEPS),
        QUILT_FINE_TUNING_THREADS="1",  # two threads on two busy cores: ten times slower
    )  # fmt: skip
    engine_port, gateway_port = free_port(), free_port()
    stack = FineTuningStack(gateway=f"http://127.0.0.1:{gateway_port}/v1", model_dir=model_dir, env=env,
                            training_queue=training_queue, media=media)  # fmt: skip
    try:
        engine = stack.processes["engine"] = launch_demo_engine(
            model_dir=model_dir, served_name=BASE_MODEL, media=media, env=env, port=engine_port
        )
        gateway = stack.processes["gateway"] = launch_gateway(env, gateway_port, media / "gateway.log")
        with django_db_blocker.unblock():
            _seed(stack)
        stack.start_trainer()
        wait_for_engine(engine)
        wait_for_gateway(gateway)
        with django_db_blocker.unblock():
            register_engine("engine-demo", f"http://127.0.0.1:{engine_port}")
        yield stack
    finally:
        tear_down_stack(stack.processes, None, redis_url=redis_url, prefix=prefix,
                        django_db_blocker=django_db_blocker, overrides=overrides)


def client(stack: FineTuningStack, tenant: str):
    import openai

    return openai.OpenAI(base_url=stack.gateway, api_key=stack.keys[tenant], max_retries=0, timeout=60)


def wait_for(check, *, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval)
    raise TimeoutError(f"{what} did not happen within {timeout} s")
