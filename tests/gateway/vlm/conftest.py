"""Images through the OpenAI API as real processes: a gateway under uvicorn, an engine on a tiny random Qwen2.5-VL
(built with transformers as the engine's own tests build it), a Celery worker for usage, PostgreSQL and Redis. Its
own package: the model is not the tiny Llama of tests/gateway's stack, and the gateway runs with small image
limits, so that each limit is reached by a small picture."""

import os
import subprocess
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import pytest

from tests.conftest import start_worker
from tests.engine.vlm_checkpoints import build_qwen2_5_vl
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

BASE_MODEL = "tiny-vl"
IMAGES_PER_REQUEST = 2
IMAGE_MAX_BYTES = 60_000
IMAGE_MAX_PIXELS = 300 * 300


@dataclass
class VisionStack:
    gateway: str  # http://127.0.0.1:PORT/v1
    model_dir: Path
    media: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    ids: dict[str, int] = field(default_factory=dict)


def _seed(stack: VisionStack) -> None:
    from django.core.management import call_command

    from apikeys.models import Scope
    from tenancy.models import Plan
    from tests.platform.factories import TenantFactory, make_key

    call_command("registerbasemodel", BASE_MODEL, str(stack.model_dir), verbosity=0)
    plan = Plan.objects.create(
        slug="vl-plan", name="Vision", requests_per_minute=10_000, tokens_per_minute=10_000_000,
        max_concurrent_requests=100, default_max_tokens=16, price_input_per_mtok=Decimal("2"),
        price_output_per_mtok=Decimal("8"), price_cached_input_per_mtok=Decimal("1"),
    )  # fmt: skip
    tenant = TenantFactory(slug="vl-main", plan=plan)
    key, plaintext = make_key(tenant, scopes=[Scope.INFERENCE], name="main")
    stack.ids["main"], stack.keys["main"] = tenant.pk, plaintext


@pytest.fixture(scope="package")
def vision_stack(django_db_setup, django_db_blocker, tmp_path_factory):
    from django.test import override_settings

    root = tmp_path_factory.mktemp("vision-stack")
    model_dir = build_qwen2_5_vl(root / "model", seed=11)
    media = root / "media"
    media.mkdir()
    redis_url = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379") + "/13"
    prefix = f"quilt-vl-{uuid.uuid4().hex[:10]}"
    overrides = override_settings(REDIS_URL=redis_url, QUILT_REDIS_KEY_PREFIX=prefix, MEDIA_ROOT=media,
                                  QUILT_ENGINE_TOKEN=ENGINE_TOKEN)  # fmt: skip
    overrides.enable()
    env = process_env(redis_url=redis_url, prefix=prefix, media=media,
                      QUILT_IMAGES_PER_REQUEST=str(IMAGES_PER_REQUEST), QUILT_IMAGE_MAX_BYTES=str(IMAGE_MAX_BYTES),
                      QUILT_IMAGE_MAX_PIXELS=str(IMAGE_MAX_PIXELS))  # fmt: skip
    engine_port, gateway_port = free_port(), free_port()
    stack = VisionStack(gateway=f"http://127.0.0.1:{gateway_port}/v1", model_dir=model_dir, media=media)
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
            register_engine("engine-vl", f"http://127.0.0.1:{engine_port}")
        yield stack
    finally:
        tear_down_stack(stack.processes, worker, redis_url=redis_url, prefix=prefix,
                        django_db_blocker=django_db_blocker, overrides=overrides)


def client(stack: VisionStack):
    import openai

    return openai.OpenAI(base_url=stack.gateway, api_key=stack.keys["main"], max_retries=0, timeout=60)
