"""Structured outputs, tool calls and outside load tools as real processes: a gateway under uvicorn, an engine on the
demo model (whose `extract` adapter answers in JSON and whose chat template knows tools), a Celery worker for usage,
PostgreSQL and Redis. Its own package: the demo model is not the tiny model of tests/gateway's stack, and the two stacks must
never share a router (this package runs, and is torn down, before that stack starts)."""

import os
import subprocess
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import pytest

from tests.conftest import REPO, start_worker
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

BASE_MODEL = "quilt-demo"


@dataclass
class DemoStack:
    gateway: str  # http://127.0.0.1:PORT/v1
    model_dir: Path
    media: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    ids: dict[str, int] = field(default_factory=dict)


def _seed(stack: DemoStack) -> None:
    from django.core.management import call_command

    from apikeys.models import Scope
    from tenancy.models import Plan
    from tests.platform.factories import TenantFactory, make_key

    call_command("registerbasemodel", BASE_MODEL, str(stack.model_dir), verbosity=0)
    plan = Plan.objects.create(
        slug="so-plan", name="Structured", requests_per_minute=10_000, tokens_per_minute=10_000_000,
        max_concurrent_requests=100, default_max_tokens=64, price_input_per_mtok=Decimal("2"),
        price_output_per_mtok=Decimal("8"), price_cached_input_per_mtok=Decimal("1"),
    )  # fmt: skip
    tenant = TenantFactory(slug="so-main", plan=plan)
    for skill in ("extract", "shout"):
        call_command("importadapter", tenant.slug, skill, str(stack.model_dir / "adapters" / skill),
                     "--base-model", BASE_MODEL, verbosity=0)  # fmt: skip
    key, plaintext = make_key(tenant, scopes=[Scope.INFERENCE], name="main")
    stack.ids["main"], stack.keys["main"] = tenant.pk, plaintext


@pytest.fixture(scope="package")
def demo_stack(django_db_setup, django_db_blocker, tmp_path_factory):
    from django.test import override_settings

    from engine.demo.builder import ensure_demo

    model_dir = ensure_demo(REPO / "var" / "demo-model")
    media = tmp_path_factory.mktemp("structured-stack")
    redis_url = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379") + "/13"
    prefix = f"quilt-so-{uuid.uuid4().hex[:10]}"
    overrides = override_settings(REDIS_URL=redis_url, QUILT_REDIS_KEY_PREFIX=prefix, MEDIA_ROOT=media,
                                  QUILT_ENGINE_TOKEN=ENGINE_TOKEN)  # fmt: skip
    overrides.enable()
    env = process_env(redis_url=redis_url, prefix=prefix, media=media)
    engine_port, gateway_port = free_port(), free_port()
    stack = DemoStack(gateway=f"http://127.0.0.1:{gateway_port}/v1", model_dir=model_dir, media=media)
    worker = None
    try:
        engine = stack.processes["engine"] = launch_demo_engine(
            model_dir=model_dir, served_name=BASE_MODEL, media=media, env=env, port=engine_port
        )
        gateway = stack.processes["gateway"] = launch_gateway(env, gateway_port, media / "gateway.log")
        with django_db_blocker.unblock():
            _seed(stack)
        worker = start_worker(extra_env={"REDIS_URL": redis_url, "QUILT_REDIS_KEY_PREFIX": prefix,
                                         "MEDIA_ROOT": str(media), "QUILT_ENGINE_TOKEN": ENGINE_TOKEN})  # fmt: skip
        drain(worker, media / "worker.log")
        wait_for_engine(engine)
        wait_for_gateway(gateway)
        with django_db_blocker.unblock():
            register_engine("engine-demo", f"http://127.0.0.1:{engine_port}")
        yield stack
    finally:
        tear_down_stack(stack.processes, worker, redis_url=redis_url, prefix=prefix,
                        django_db_blocker=django_db_blocker, overrides=overrides)


def client(stack: DemoStack):
    import openai

    return openai.OpenAI(base_url=stack.gateway, api_key=stack.keys["main"], max_retries=0, timeout=60)
