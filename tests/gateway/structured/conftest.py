"""Structured outputs, tool calls and outside load tools as real processes: a gateway under uvicorn, an engine on the
demo model (whose `extract` adapter answers in JSON and whose chat template knows tools), a Celery worker for usage,
PostgreSQL and Redis. Its own package: the demo model is not the tiny model of tests/gateway's stack, and the two stacks must
never share a router (this package runs, and is torn down, before that stack starts)."""

from decimal import Decimal

import pytest

from tests.conftest import REPO
from tests.gateway.conftest import SingleEngineStack as DemoStack
from tests.gateway.conftest import single_engine_stack

BASE_MODEL = "quilt-demo"


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
    from engine.demo.builder import ensure_demo

    model_dir = ensure_demo(REPO / "var" / "demo-model")
    media = tmp_path_factory.mktemp("structured-stack")
    stack = DemoStack(gateway="", model_dir=model_dir, media=media)
    with single_engine_stack(stack.processes, model_dir=model_dir, served_name=BASE_MODEL, media=media,
                             django_db_blocker=django_db_blocker, seed=lambda: _seed(stack)) as gateway:  # fmt: skip
        stack.gateway = gateway
        yield stack


def client(stack: DemoStack):
    import openai

    return openai.OpenAI(base_url=stack.gateway, api_key=stack.keys["main"], max_retries=0, timeout=60)
