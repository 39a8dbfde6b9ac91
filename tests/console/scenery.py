"""A lived-in platform for screenshots: tenants on several plans, members, keys, adapters with versions, a month
of usage rolled up, an issued invoice and two engines reporting state. Everything goes through the services."""

import random
import tempfile
from datetime import UTC, datetime, time, timedelta
from decimal import Decimal
from pathlib import Path

from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from apikeys.selectors import api_key_authenticate
from apikeys.services import api_key_create, api_key_revoke
from billing.invoices import invoice_issue, previous_month
from gateway.models import Engine
from metering.rollups import usage_rollup_recent
from metering.selectors import usage_totals_month
from metering.services import usage_ingest
from registry.models import AdapterVersion
from registry.promotion import adapter_promote
from registry.services import adapter_create, adapter_version_create
from registry.validation import adapter_version_validate
from tenancy.audit import Actor
from tenancy.models import Membership, Plan
from tenancy.services import member_add, plan_update, tenant_create, tenant_update
from tests.console.builders import BASE_NAME, usage_event
from tests.engine_states import adapters, engine_state_json, memory
from tests.platform.factories import UserFactory

CENT = Decimal("0.01")
PLANS = {
    "starter": {"price_input_per_mtok": Decimal("0.40"), "price_cached_input_per_mtok": Decimal("0.10"),
                "price_output_per_mtok": Decimal("1.20"), "monthly_spend_limit": Decimal("250.00")},
    "scale": {"price_input_per_mtok": Decimal("0.30"), "price_cached_input_per_mtok": Decimal("0.075"),
              "price_output_per_mtok": Decimal("0.90"), "monthly_spend_limit": Decimal("5000.00")},
}  # fmt: skip


def _plan(slug: str) -> Plan:
    plan = Plan.objects.get_or_create(slug=slug, defaults={"name": slug.title()})[0]
    return plan_update(actor=Actor.system(), plan=plan, changes=PLANS[slug])


def _adapter(tenant, name: str, zips: list[bytes], owner, description: str, *, promote_second: bool):
    actor = Actor(user=owner)
    upload = SimpleUploadedFile(f"{name}.zip", zips[0], content_type="application/zip")
    adapter = adapter_create(actor=actor, tenant=tenant, name=name, base_model=BASE_NAME, files=[upload],
                             description=description, enqueue=False)  # fmt: skip
    adapter_version_validate(version_id=adapter.versions.get(number=1).pk)
    second = adapter_version_create(
        actor=actor, adapter=adapter, files=[SimpleUploadedFile(f"{name}-v2.zip", zips[1])], enqueue=False
    )
    adapter_version_validate(version_id=second.pk)
    if promote_second:
        adapter_promote(actor=actor, adapter=adapter, version_number=2)
    return adapter


def build(*, zips: list[bytes], staff) -> dict:
    """Returns the main tenant and its owner; the owner's password is 'pw-12345-secret'."""
    rng = random.Random(7)
    system = Actor(user=staff)
    starter, scale = _plan("starter"), _plan("scale")
    acme = tenant_create(actor=system, slug="acme", name="Acme Corp", plan=scale, billing_email="billing@acme.test")
    others = [
        tenant_create(actor=system, slug=slug, name=name, plan=plan)
        for slug, name, plan in [("globex", "Globex", starter), ("initech", "Initech", starter),
                                 ("umbrella", "Umbrella Health", scale), ("hooli", "Hooli", starter)]
    ]  # fmt: skip
    tenant_update(actor=system, tenant=others[2], changes={"status": "suspended"})
    owner = UserFactory(username="dana", first_name="Dana", last_name="Scully", email="dana@acme.test")
    member_add(actor=system, tenant=acme, role=Membership.Role.OWNER, username=owner.username)
    for username, role in [("fox", "admin"), ("walter", "developer"), ("monica", "developer"), ("john", "viewer")]:
        UserFactory(username=username, email=f"{username}@acme.test")
        member_add(actor=Actor.system(), tenant=acme, role=role, username=username)
    member_add(actor=Actor.system(), tenant=acme, role="viewer", email="new.hire@acme.test")
    created = [
        api_key_create(actor=Actor(user=owner), tenant=acme, name=name, scopes=scopes)
        for name, scopes in [("production backend", ["inference"]), ("support bot", ["inference"]),
                             ("CI uploads", ["adapters:write"]), ("finance export", ["usage:read"]),
                             ("old prototype", ["inference", "admin"])]
    ]  # fmt: skip
    keys = [key for key, _ in created]
    for _, plaintext in created[:3]:
        api_key_authenticate(presented=plaintext)
    api_key_revoke(actor=Actor(user=owner), key=keys[-1])
    _adapter(acme, "support-bot", zips[:2], owner, "Tier-1 support replies in our tone", promote_second=True)
    writer = _adapter(acme, "sql-writer", zips[2:4], owner, "Text to SQL over the analytics warehouse",
                      promote_second=False)  # fmt: skip
    broken = adapter_version_create(actor=Actor(user=owner), adapter=writer, enqueue=False,
                                    files=[SimpleUploadedFile("sql-writer-wide.zip", _too_wide_zip())])  # fmt: skip
    adapter_version_validate(version_id=broken.pk)
    Engine.objects.create(
        name="gpu-a", url="http://10.0.0.5:8100", pool="default", gpu_price_per_hour=Decimal("2.4900"),
        healthy=True, last_checked_at=timezone.now(), state=_engine_state(rng),
    )  # fmt: skip
    Engine.objects.create(
        name="gpu-b", url="http://10.0.0.6:8100", pool="default", gpu_price_per_hour=Decimal("2.4900"),
        healthy=False, last_checked_at=timezone.now(), last_error="ConnectError: connection refused", state={},
    )  # fmt: skip
    _usage(rng, acme, keys[:2], others)
    spend = usage_totals_month(tenant=acme, month=timezone.now().date()).price
    if spend:  # the budget bar shows amber: 86% of the month's limit used
        plan_update(actor=system, plan=scale, changes={"monthly_spend_limit": (spend / Decimal("0.86")).quantize(CENT)})
    invoice_issue(tenant=acme, month=previous_month(timezone.now().date()))
    return {"tenant": acme, "owner": owner}


def _too_wide_zip() -> bytes:
    """A real PEFT adapter made for a wider model: it passes the upload checks and fails validation on shapes."""
    from tests.tiny_llama import save_peft_adapter, zipped

    with tempfile.TemporaryDirectory() as folder:
        return zipped(save_peft_adapter(Path(folder) / "wide", seed=9, hidden_size=48))


def _engine_state(rng) -> dict:
    digests = list(AdapterVersion.objects.exclude(digest="").values_list("digest", flat=True))
    return engine_state_json(
        model=BASE_NAME, running=14, waiting=3, kv_blocks_used=1730, kv_blocks_free=318, kv_blocks_total=2048,
        prefix_cache_hit_rate=0.62, tokens_per_second=2843.5, steps=918_233, preemptions=12,
        adapters=adapters(gpu=digests[:2], host=digests[2:]),
        memory=memory(page_bytes=2 << 20, pages_total=4096, base_weights_bytes=16 << 30, kv_pages_bytes=3460 << 20,
                      adapter_pages_bytes=96 << 20, free_bytes=4636 << 20),
    )  # fmt: skip


def _usage(rng, acme, keys, others) -> None:
    today = timezone.now().date()
    events = []
    for offset in range(45):
        day = today - timedelta(days=offset)
        weekday_boost = 1.0 if day.weekday() < 5 else 0.55
        for _ in range(int(rng.randint(14, 22) * weekday_boost)):
            finished = datetime.combine(day, time(hour=rng.randint(0, 23), minute=rng.randint(0, 59)), tzinfo=UTC)
            finished = min(finished, timezone.now() - timedelta(minutes=1))
            model = rng.choice(["support-bot", "support-bot", "sql-writer", BASE_NAME])
            events.append(usage_event(
                acme, model=model, api_key=rng.choice(keys), finished_at=finished,
                prompt_tokens=rng.randint(40_000, 120_000), cached_tokens=rng.randint(5_000, 30_000),
                completion_tokens=rng.randint(8_000, 40_000), gpu_ms=rng.uniform(3_000, 12_000), engine="gpu-a",
            ))  # fmt: skip
        for tenant in others[:2]:
            events.append(usage_event(tenant, finished_at=datetime.combine(day, time(12), tzinfo=UTC),
                                      prompt_tokens=30_000, cached_tokens=0, completion_tokens=9_000, engine="gpu-a",
                                      gpu_ms=4_000.0))  # fmt: skip
    usage_ingest(events=events)
    usage_rollup_recent()
