"""Engines: registering them, checking their health, and warming adapters on them."""

import logging
from datetime import timedelta
from decimal import Decimal, InvalidOperation

import httpx
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Subquery
from django.utils import timezone

from engine.contract import Heartbeat, state_builtins
from gateway import engine_client
from gateway.models import Engine, EngineLife
from registry.storage import canonical_urls
from tenancy.audit import Actor, audit_record

log = logging.getLogger(__name__)


def _snapshot(engine: Engine) -> dict:
    return {
        "url": engine.url, "pool": engine.pool, "gpu_price_per_hour": str(engine.gpu_price_per_hour),
        "enabled": engine.enabled,
    }  # fmt: skip


def engine_register(
    *, actor: Actor, name: str, url: str, token: str = "", pool: str = "default",
    gpu_price_per_hour: Decimal = Decimal(0), enabled: bool = True,
) -> Engine:  # fmt: skip
    """Creates the engine or updates the one of that name, then checks its health once."""
    with transaction.atomic():
        engine = Engine.objects.select_for_update().filter(name=name).first()
        before = _snapshot(engine) if engine is not None else None
        engine = engine or Engine(name=name)
        engine.url, engine.token, engine.pool = url.rstrip("/"), token, pool
        engine.gpu_price_per_hour, engine.enabled = gpu_price_per_hour, enabled
        engine.full_clean()
        engine.save()
        audit_record(
            actor=actor, action="engine.register", target=engine, tenant=None, before=before, after=_snapshot(engine)
        )
    return engine_check(engine=engine)


def engine_check(*, engine: Engine) -> Engine:
    """Asks the engine for its health and state; records whether it answered."""
    try:
        state = engine_client.state_sync(url=engine.url, token=engine.token)
    except (httpx.HTTPError, ValueError) as error:  # ValueError: a state this side cannot read (BadState, WrongVersion)
        healthy, message = False, f"{type(error).__name__}: {error}"
    else:
        healthy, message = True, ""
        engine.state, engine.role = state_builtins(state), state.role  # a static engine says its role in /v1/state
    if healthy != engine.healthy:
        log.warning("engine %s is now %s %s", engine.name, "healthy" if healthy else "unhealthy", message)
    engine.healthy, engine.last_error = healthy, message
    engine.last_checked_at = timezone.now()
    engine.save(update_fields=["healthy", "state", "role", "last_error", "last_checked_at"])
    return engine


def engines_check() -> list[Engine]:
    """Polls the static engines (`registerengine`); those that registered themselves report by heartbeat."""
    return [engine_check(engine=engine) for engine in Engine.objects.filter(enabled=True, self_registered=False)]


HEARTBEAT_MISSES = 3  # heartbeats an engine may miss before it leaves routing
HEARTBEAT_INTERVAL_LIMITS = (0.2, 60.0)


class HeartbeatRefused(Exception):
    """A heartbeat the control plane will not record (bad field, or a name a static engine holds): a 4xx."""

    def __init__(self, message: str, *, status: int = 400):
        super().__init__(message)
        self.status = status


def engine_heartbeat(*, heartbeat: Heartbeat) -> Engine:
    """Records a self-registered engine's heartbeat: it joins on its first one, and stays in routing for
    HEARTBEAT_MISSES intervals unless it says it is draining (then it leaves at once)."""
    name, url, pool, draining = heartbeat.name, heartbeat.url, heartbeat.pool, heartbeat.draining
    try:
        price = Decimal(heartbeat.gpu_price_per_hour)
    except InvalidOperation:
        raise HeartbeatRefused("gpu_price_per_hour must be a decimal number") from None
    low, high = HEARTBEAT_INTERVAL_LIMITS
    if not low <= heartbeat.interval_s <= high:
        raise HeartbeatRefused(f"interval_s must be a number of seconds from {low} to {high}")
    now = timezone.now()
    with transaction.atomic():
        engine = Engine.objects.select_for_update().filter(name=name).first()
        if engine is not None and not engine.self_registered:
            raise HeartbeatRefused(f"engine {name!r} is registered statically (registerengine): pick another name",
                                   status=409)
        joined = engine is None or engine.heartbeat_expires_at is None or engine.heartbeat_expires_at <= now
        before = _snapshot(engine) if engine is not None else None
        engine = engine or Engine(name=name, self_registered=True)
        engine.url, engine.token, engine.pool, engine.gpu_price_per_hour = url.rstrip("/"), "", pool, price
        engine.role = heartbeat.state.role
        engine.healthy, engine.state, engine.last_error = not draining, state_builtins(heartbeat.state), ""
        engine.heartbeat_at = engine.last_checked_at = now
        engine.heartbeat_expires_at = now if draining else now + timedelta(seconds=HEARTBEAT_MISSES * heartbeat.interval_s)
        try:
            engine.full_clean()
        except ValidationError as error:
            raise HeartbeatRefused("; ".join(f"{k}: {' '.join(v)}" for k, v in error.message_dict.items())) from None
        engine.save()
        engine_life_record(engine=engine, now=now, joined=joined and not draining)
        if joined and not draining:
            audit_record(actor=Actor.system(), action="engine.join", target=engine, tenant=None, before=before,
                         after=_snapshot(engine))  # fmt: skip
        elif draining and before is not None:
            audit_record(actor=Actor.system(), action="engine.leave", target=engine, tenant=None, before=before,
                         after=_snapshot(engine))  # fmt: skip
    if joined and not draining:
        log.info("engine %s joined at %s", name, engine.url)
    elif draining:
        log.info("engine %s is draining: out of routing", name)
    return engine


def engine_state_refused(*, name: str, message: str) -> None:
    """A heartbeat whose state this side cannot read (a field, another version): the self-registered engine of that
    name, if any, is unhealthy (out of routing at once) with the reason, until a heartbeat it can read comes."""
    log.warning("engine %s: heartbeat refused: %s", name, message)
    engine = Engine.objects.filter(name=name, self_registered=True).first()
    if engine is not None:
        engine.healthy, engine.last_error, engine.last_checked_at = False, message, timezone.now()
        engine.save(update_fields=["healthy", "last_error", "last_checked_at"])


def engine_life_record(*, engine: Engine, now, joined: bool) -> None:
    """A heartbeat's mark on the engine's lives: a join starts one, any other heartbeat (draining ones too: the
    engine still runs) extends its latest to now."""
    latest = EngineLife.objects.filter(engine=engine).order_by("-started_at").values("pk")[:1]
    if joined or not EngineLife.objects.filter(pk__in=Subquery(latest)).update(last_heartbeat_at=now):
        EngineLife.objects.create(engine=engine, started_at=now, last_heartbeat_at=now)


def adapter_prefetch_successor(*, old_digest: str | None, new_digest: str, new_path: str) -> list[str]:
    """Asks every engine up that held the old version to warm the new one; returns their names."""
    if not old_digest or old_digest == new_digest:
        return []
    urls = canonical_urls(digest=new_digest)
    adapter = {"digest": new_digest, "path": new_path} if urls is None else {"digest": new_digest, "urls": urls}
    warmed = []
    for engine in Engine.objects.up().filter(enabled=True):
        state = engine.reported_state()
        if state is None or old_digest not in state.resident_digests():
            continue
        try:
            engine_client.prefetch_sync(url=engine.url, token=engine.token, adapter=adapter)
        except httpx.HTTPError as error:
            log.warning("prefetch of %s on %s failed: %s", new_digest[:12], engine.name, error)
            continue
        warmed.append(engine.name)
    return warmed


def admission_reconcile_all() -> int:
    """Reconciles admission's month total with metering's record for every tenant whose plan has a budget or a
    spend limit (the only ones admission's totals decide for); returns how many totals changed."""
    from gateway.admission import admission_reconcile
    from tenancy.models import Tenant

    changed = 0
    budgeted = Tenant.objects.filter(plan__monthly_token_budget__isnull=False) | Tenant.objects.filter(
        plan__monthly_spend_limit__isnull=False
    )
    for tenant_id in budgeted.values_list("pk", flat=True).distinct():
        result = admission_reconcile(tenant_id=tenant_id)
        if result is None:
            continue
        if not result.applied:
            log.warning("admission total of tenant %s not reconciled: usage kept settling; next run", tenant_id)
        elif (result.tokens_before, result.spend_picos_before) != (result.tokens_after, result.spend_picos_after):
            changed += 1
            log.warning(
                "admission total of tenant %s reconciled: %s -> %s tokens, %s -> %s picos", tenant_id,
                result.tokens_before, result.tokens_after, result.spend_picos_before, result.spend_picos_after,
            )  # fmt: skip
    return changed + _key_totals_reconcile()


def _key_totals_reconcile() -> int:
    """The same for every key lineage with a monthly budget: its spend (picos) set to metering's record of the
    lineage plus its provisional settles."""
    from apikeys.models import ApiKey
    from gateway.admission import key_reconcile

    changed = 0
    budgeted = ApiKey.objects.filter(monthly_spend_limit__isnull=False, revoked=False)
    for tenant_id, lineage in budgeted.values_list("tenant_id", "lineage").distinct():
        result = key_reconcile(tenant_id=tenant_id, key_prefix=lineage)
        if result is None or not result.applied:
            continue
        if result.spend_picos_before != result.spend_picos_after:
            changed += 1
            log.warning("spend of key %s reconciled: %s -> %s picos", lineage, result.spend_picos_before,
                        result.spend_picos_after)  # fmt: skip
    return changed
