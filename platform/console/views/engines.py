"""Staff page of the engines: health, queue, KV-cache use, the memory split, resident adapters by tier, each adapter's
residency (tier, pinned, rank), the pins the platform asked for and what the engine answered, throughput.

The grid is rendered by `engines_grid_html`, both for the page and for the websocket that keeps it live.
"""

from datetime import timedelta

from django.db.models import Count
from django.template.loader import render_to_string
from django.utils import timezone

from console.access import staff_page
from console.pages import render_page
from engine.contract import EngineState
from gateway.models import Engine, EnginePin
from metering.models import UsageEvent
from registry.models import AdapterVersion

RESIDENCY_TIER = {"device": "GPU", "host": "Host"}  # the engine pool's tier names in `adapters.residency`
TIERS = (("gpu", "GPU"), ("host", "Host memory only"), ("loading", "Loading"))
NAME_WINDOW_DAYS = 30
# The engine's accelerator memory as `/v1/state` reports it: weights, then one page pool shared by KV and adapters.
MEMORY_PARTS = (("base_weights", "Base weights"), ("kv_pages", "KV pages"), ("adapter_pages", "Adapter pages"),
                ("free", "Free"))  # fmt: skip


def memory_parts(state: EngineState | None) -> list[dict]:
    """[{kind, label, bytes, percent}] from the state's `memory`; empty when the engine reported none."""
    if state is None:
        return []
    sizes = [(kind, label, getattr(state.memory, f"{kind}_bytes")) for kind, label in MEMORY_PARTS]
    total = sum(size for _, _, size in sizes)
    if not total:
        return []
    return [{"kind": kind, "label": label, "bytes": size, "percent": round(100 * size / total, 1)}
            for kind, label, size in sizes]  # fmt: skip


def adapter_tiers(state: EngineState | None) -> dict[str, list[str]]:
    """Each adapter's digest in the one tier it is really in: an adapter on the GPU keeps its copy in host memory
    too (the engine lists it in both), so "host" holds only those in host memory and not on the GPU."""
    tiers, seen = {}, set()
    for tier, _ in TIERS:
        digests = [] if state is None else [d for d in getattr(state.adapters, tier) if d not in seen]
        seen.update(digests)
        tiers[tier] = digests
    return tiers


def adapter_names(digests: set[str]) -> dict[str, list[str]]:
    """Digest -> the names of every adapter version with those tensors (identical uploads share one digest),
    the one with the most requests in the last NAME_WINDOW_DAYS first."""
    versions = list(AdapterVersion.objects.filter(digest__in=digests).select_related("adapter__tenant"))
    since = timezone.now() - timedelta(days=NAME_WINDOW_DAYS)
    used = dict(
        UsageEvent.objects.filter(adapter_version__in=versions, finished_at__gte=since).order_by()
        .values_list("adapter_version").annotate(requests=Count("id"))
    )  # fmt: skip
    versions.sort(key=lambda version: (-used.get(version.pk, 0), version.pk))
    names: dict[str, list[str]] = {}
    for version in versions:
        names.setdefault(version.digest, []).append(
            f"{version.adapter.tenant.slug}/{version.adapter.name}@{version.number}"
        )
    return names


def adapter_residency(state: EngineState | None, names: dict[str, list[str]]) -> list[dict]:
    """[{name, digest, tier, pinned, rank}] per adapter and memory tier, from the state's `adapters.residency` (the
    same entries as the engine's quilt_engine_adapter_resident series), GPU first."""
    return [{"name": (names.get(entry.digest) or [entry.digest[:12]])[0], "digest": entry.digest,
             "tier": RESIDENCY_TIER[entry.tier], "pinned": entry.pinned, "rank": entry.rank}
            for entry in (state.adapters.residency if state is not None else ())]  # fmt: skip


def engine_cards() -> list[dict]:
    engines = list(Engine.objects.order_by("-enabled", "name"))
    states = {engine.pk: engine.reported_state() for engine in engines}
    tiers_of = {engine.pk: adapter_tiers(states[engine.pk]) for engine in engines}
    pins_of: dict[int, list[EnginePin]] = {}
    for pin in EnginePin.objects.filter(engine__in=engines).order_by("status", "digest"):
        pins_of.setdefault(pin.engine_id, []).append(pin)
    names = adapter_names({digest for tiers in tiers_of.values() for digests in tiers.values() for digest in digests}
                         | {pin.digest for pins in pins_of.values() for pin in pins})
    cards = []
    for engine in engines:
        state = states[engine.pk]
        total, used = (state.kv_blocks_total, state.kv_blocks_used) if state is not None else (0, 0)
        tiers = [
            (label, [names.get(digest) or [digest[:12]] for digest in tiers_of[engine.pk][tier]]) for tier, label in TIERS
        ]
        cards.append({
            "engine": engine,
            "state": state,
            "kv_percent": round(100 * used / total) if total else 0,
            "hit_percent": round(100 * state.prefix_cache_hit_rate) if state is not None else 0,
            "tiers": tiers,
            "memory": memory_parts(state),
            "residency": adapter_residency(state, names),
            "pins": [{"name": (names.get(pin.digest) or [pin.digest[:12]])[0], "pin": pin} for pin in pins_of.get(engine.pk, [])],
        })  # fmt: skip
    return cards


def engines_grid_html() -> str:
    return render_to_string("console/engines/_grid.html", {"cards": engine_cards()})


def seconds_to_next_expiry() -> float | None:
    """Seconds until the next self-registered engine's heartbeats run out (it is then down, though no row changes:
    the live page looks again then); None when no engine is waiting on a heartbeat."""
    soonest = (Engine.objects.up().filter(self_registered=True).order_by("heartbeat_expires_at")
               .values_list("heartbeat_expires_at", flat=True).first())  # fmt: skip
    return None if soonest is None else max(0.0, (soonest - timezone.now()).total_seconds())


@staff_page
def engines(request):
    return render_page(request, "console/engines/list.html", {"grid": engines_grid_html()}, section="engines")
