"""Helpers shared by the money tests: a priced plan, an engine with a GPU price, and usage events as the engine
sends them (engine.contract.UsageEvent, as decoded JSON)."""

from datetime import UTC, datetime
from decimal import Decimal
from itertools import count

from gateway.models import Engine
from registry.models import Adapter, AdapterVersion, BaseModel
from tenancy.models import Plan, Tenant
from tests.platform.factories import TenantFactory

_ids = count(1)
BASE_MODEL = "tiny-llama"


def priced_plan(slug: str = "metered", **fields) -> Plan:
    values = {
        "name": slug.title(),
        "price_input_per_mtok": Decimal("0.500000"),
        "price_cached_input_per_mtok": Decimal("0.125000"),
        "price_output_per_mtok": Decimal("1.500000"),
        **fields,
    }
    return Plan.objects.update_or_create(slug=slug, defaults=values)[0]


def priced_tenant(slug: str, **plan_fields) -> Tenant:
    return TenantFactory(slug=slug, plan=priced_plan(f"plan-{slug}", **plan_fields))


def gpu_engine(name: str = "engine-1", price: str = "2.5000") -> Engine:
    return Engine.objects.update_or_create(
        name=name,
        defaults={"url": "http://127.0.0.1:9", "pool": "default", "gpu_price_per_hour": Decimal(price)},
    )[0]


def adapter_version(tenant: Tenant, name: str = "support-bot", number: int = 1) -> AdapterVersion:
    base = BaseModel.objects.get_or_create(
        name=BASE_MODEL,
        defaults={"checkpoint_dir": "/nowhere", "architecture": "llama", "config": {}, "max_context": 64},
    )[0]
    adapter = Adapter.objects.get_or_create(tenant=tenant, name=name, defaults={"base_model": base})[0]
    return AdapterVersion.objects.create(adapter=adapter, number=number, status="ready", digest="ab" * 32)


def usage_event(
    tenant: Tenant, *, request_id: str | None = None, finished_at: datetime | None = None, **fields
):
    finished_at = finished_at or datetime(2026, 10, 15, 12, 0, tzinfo=UTC)
    model = fields.pop("model", BASE_MODEL)
    api_key_id = fields.pop("api_key_id", None)
    engine = fields.pop("engine", "engine-1")
    metadata = {"model": model, "engine": engine}
    metadata.update(fields.pop("metadata", {}))
    return {
        "request_id": request_id or f"req-{next(_ids):08d}",
        "tenant": str(tenant.pk),
        "api_key_id": None if api_key_id is None else str(api_key_id),
        "adapter_digest": None,
        "base_model": BASE_MODEL,
        "prompt_tokens": 1000,
        "cached_tokens": 200,
        "completion_tokens": 300,
        "gpu_ms": 120.5,
        "queue_ms": 3.0,
        "ttft_ms": 15.0,
        "e2e_ms": 140.0,
        "finish_reason": "stop",
        "finished_at": finished_at.isoformat(),
        "v": 1,
        "metadata": metadata,
        **fields,
    }
