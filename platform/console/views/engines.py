"""Staff page of the engines: health, queue, KV-cache use, resident adapters by tier, throughput.

The grid is rendered by `engines_grid_html`, both for the page and for the websocket that keeps it live.
"""

from django.template.loader import render_to_string

from console.access import staff_page
from console.pages import render_page
from gateway.models import Engine
from registry.models import AdapterVersion

TIERS = (("gpu", "GPU"), ("host", "Host memory"), ("loading", "Loading"))


def _digests(state: dict) -> set[str]:
    adapters = state.get("adapters") or {}
    return {digest for tier, _ in TIERS for digest in adapters.get(tier) or [] if isinstance(digest, str)}


def engine_cards() -> list[dict]:
    engines = list(Engine.objects.order_by("-enabled", "name"))
    digests = set().union(*(_digests(engine.state or {}) for engine in engines))
    names = {
        version.digest: f"{version.adapter.tenant.slug}/{version.adapter.name}@{version.number}"
        for version in AdapterVersion.objects.filter(digest__in=digests).select_related("adapter__tenant")
    }
    cards = []
    for engine in engines:
        state = engine.state or {}
        adapters = state.get("adapters") or {}
        total = state.get("kv_blocks_total") or 0
        used = state.get("kv_blocks_used") or 0
        tiers = [
            (label, [names.get(digest, digest[:12]) for digest in adapters.get(tier) or [] if isinstance(digest, str)])
            for tier, label in TIERS
        ]
        cards.append({
            "engine": engine,
            "state": state,
            "kv_percent": round(100 * used / total) if total else 0,
            "hit_percent": round(100 * (state.get("prefix_cache_hit_rate") or 0)),
            "tiers": tiers,
            "gpu_slots": adapters.get("gpu_slots"),
        })  # fmt: skip
    return cards


def engines_grid_html() -> str:
    return render_to_string("console/engines/_grid.html", {"cards": engine_cards()})


@staff_page
def engines(request):
    return render_page(request, "console/engines/list.html", {"grid": engines_grid_html()}, section="engines")
