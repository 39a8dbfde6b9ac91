"""Always-warm adapters on the engines (docs/residency.md, "Pins"): which adapters the platform wants pinned, and the
sync that makes each engine up hold those pins, records what it answered (EnginePin) and unpins what is no longer
wanted. A pin an engine refuses (its tier's budget cannot hold it) stays a `refused` row with the engine's words, shown
on the console's engine page; the next sync asks again, so a pin that fits once others are gone is taken then."""

import logging

import httpx
from django.conf import settings

from gateway.models import Engine, EnginePin
from registry.models import Adapter
from registry.storage import adapter_store_root, canonical_urls

log = logging.getLogger(__name__)

PIN_TIMEOUT_SECONDS = 60.0  # the engine may read the adapter first
POOL_TIER = {"device": "gpu", "host": "host"}  # the engine's /v1/state names -> its API's


def warm_adapters() -> dict[str, str]:
    """digest -> tier ("host" or "gpu") of every live adapter's current version to pin: the adapter's own tier, else
    its tenant's plan's. Where two adapters share a digest, "gpu" wins."""
    rows = (Adapter.objects.filter(deleted_at__isnull=True, current_version__isnull=False)
            .exclude(current_version__digest="")
            .values_list("current_version__digest", "warm_tier", "tenant__plan__adapter_warm_tier"))  # fmt: skip
    wanted: dict[str, str] = {}
    for digest, own, plan in rows:
        tier = own or plan
        if tier and wanted.get(digest) != "gpu":
            wanted[digest] = tier
    return wanted


def engine_pins(engine: Engine) -> dict[str, str]:
    """digest -> API tier of the pins the engine's last state reports."""
    state = engine.reported_state()
    return {} if state is None else {digest: POOL_TIER[tier] for digest, tier in state.adapters.pinned.items()}


def engine_pins_sync(*, engine: Engine, wanted: dict[str, str]) -> dict[str, str]:
    """Make the engine hold exactly the `wanted` pins; returns digest -> status of each wanted pin."""
    headers = {"Authorization": f"Bearer {engine.token or settings.QUILT_ENGINE_TOKEN}"}
    held = engine_pins(engine)
    outcome: dict[str, str] = {}
    with httpx.Client(base_url=engine.url.rstrip("/"), headers=headers, timeout=PIN_TIMEOUT_SECONDS) as client:
        for digest in set(held) - set(wanted):  # first: their room may be what a wanted pin needs
            try:
                client.post("/v1/adapters/unpin", json={"digest": digest}).raise_for_status()
            except httpx.HTTPError as error:
                log.warning("unpin of %s on %s failed: %s", digest[:12], engine.name, error)
        for digest, tier in wanted.items():
            recorded = EnginePin.objects.filter(engine=engine, digest=digest, tier=tier, status="pinned").exists()
            if held.get(digest) == tier and recorded:
                outcome[digest] = "pinned"
                continue
            status, message = _pin(client, digest, tier)
            EnginePin.objects.update_or_create(engine=engine, digest=digest,
                                               defaults={"tier": tier, "status": status, "message": message})
            outcome[digest] = status
            if status != "pinned":
                log.warning("pin of %s in %s on %s %s: %s", digest[:12], tier, engine.name, status, message)
    EnginePin.objects.filter(engine=engine).exclude(digest__in=list(wanted)).delete()
    return outcome


def engine_pins_sync_all() -> int:
    """Every enabled engine up holds the wanted pins; returns how many pins were refused or failed."""
    wanted = warm_adapters()
    missed = 0
    for engine in Engine.objects.up().filter(enabled=True):
        missed += sum(status != "pinned" for status in engine_pins_sync(engine=engine, wanted=wanted).values())
    return missed


def _pin(client: httpx.Client, digest: str, tier: str) -> tuple[str, str]:
    urls = canonical_urls(digest=digest)
    adapter = {"digest": digest, "path": str(adapter_store_root() / digest)} if urls is None else \
        {"digest": digest, "urls": urls}
    try:
        answer = client.post("/v1/adapters/pin", json={**adapter, "tier": tier})
    except httpx.HTTPError as error:
        return "failed", f"the engine could not be reached: {error}"
    if answer.status_code == 200:
        return "pinned", ""
    try:
        error = answer.json()["error"]
        code, message = error.get("code"), error["message"]
    except (ValueError, KeyError, TypeError):
        code, message = None, f"HTTP {answer.status_code}"
    return ("refused" if code == "pin_refused" else "failed"), message
