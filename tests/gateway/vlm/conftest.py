"""Images through the OpenAI API as real processes: a gateway under uvicorn, an engine on a tiny random Qwen2.5-VL
(built with transformers as the engine's own tests build it), a Celery worker for usage, PostgreSQL and Redis. Its
own package: the model is not the tiny Llama of tests/gateway's stack, and the gateway runs with small image
limits, so that each limit is reached by a small picture."""

from decimal import Decimal

import pytest

from tests.engine.vlm_checkpoints import build_vlm
from tests.gateway.conftest import METRICS_TOKEN, single_engine_stack
from tests.gateway.conftest import SingleEngineStack as VisionStack

BASE_MODEL = "tiny-vl"
IMAGES_PER_REQUEST = 2
IMAGE_MAX_BYTES = 60_000
IMAGE_MAX_PIXELS = 300 * 300


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
    root = tmp_path_factory.mktemp("vision-stack")
    model_dir = build_vlm(root / "model", "qwen2_5_vl", seed=11)
    media = root / "media"
    media.mkdir()
    stack = VisionStack(gateway="", model_dir=model_dir, media=media)
    with single_engine_stack(stack.processes, model_dir=model_dir, served_name=BASE_MODEL, media=media,
                             django_db_blocker=django_db_blocker, seed=lambda: _seed(stack),
                             QUILT_IMAGES_PER_REQUEST=str(IMAGES_PER_REQUEST),
                             QUILT_IMAGE_MAX_BYTES=str(IMAGE_MAX_BYTES),
                             QUILT_IMAGE_MAX_PIXELS=str(IMAGE_MAX_PIXELS), QUILT_METRICS_TOKEN=METRICS_TOKEN,
                             QUILT_PREFILL_HOP_MIN_UNCACHED_TOKENS="32") as gateway:  # fmt: skip
        stack.gateway = gateway
        yield stack


def client(stack: VisionStack):
    import openai

    return openai.OpenAI(base_url=stack.gateway, api_key=stack.keys["main"], max_retries=0, timeout=60)
