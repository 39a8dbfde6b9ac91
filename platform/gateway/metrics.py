"""The gateway's Prometheus metrics, per process: requests, time to first token, latency, tokens and refusals by
tenant, model (as requested) and adapter (digest prefix, or "base"). Served at /metrics to a scraper that
presents `Authorization: Bearer $QUILT_METRICS_TOKEN`; with no token configured the endpoint does not exist
(tenant ids and model names are not for the public)."""

import hmac

from django.conf import settings
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway.metric_counts import Counter, Histogram

registry = CollectorRegistry()
LABELS = ("tenant", "model", "adapter")
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

requests = Counter("quilt_gateway_requests", "Admitted inference requests by how they ended", [*LABELS, "outcome"],
                   registry=registry)  # fmt: skip
refusals = Counter("quilt_gateway_refusals", "Requests refused by admission, by reason", ["tenant", "reason"],
                   registry=registry)  # fmt: skip
ttft = Histogram("quilt_gateway_ttft_seconds", "From the request's arrival to its first token leaving the gateway",
                 LABELS, buckets=SECONDS, registry=registry)  # fmt: skip
latency = Histogram("quilt_gateway_request_seconds", "From the request's arrival to its end", LABELS,
                    buckets=SECONDS, registry=registry)  # fmt: skip
tokens = Counter("quilt_gateway_tokens", "Tokens of admitted requests as the engine counted them",
                 [*LABELS, "kind"], registry=registry)  # fmt: skip
# disaggregated prefill/decode (docs/kv-tiers.md)
disaggregation = Counter(
    "quilt_gateway_disaggregation", "Requests on a fleet with prefill/decode roles, by route: disaggregated (a "
    "prefill hop, then the decode engine), short (the uncached prompt is under the threshold: no hop), fallback (the "
    "prefill hop failed: one engine served it whole), refused (the prefill engine refused the request itself: the "
    "client's 400), no_prefill_engine", ["route"], registry=registry)  # fmt: skip
prefill_fallbacks = Counter("quilt_gateway_prefill_fallbacks", "Prefill hops that gave no lease, by reason",
                            ["reason"], registry=registry)  # fmt: skip
prefill_seconds = Histogram("quilt_gateway_prefill_hop_seconds", "The prefill hop, from sending it to its lease",
                            buckets=SECONDS, registry=registry)  # fmt: skip
kv_transfers = Counter("quilt_gateway_kv_transfers", "Decode hops by what the decode engine said it did with the "
                       "lease: pulled the blocks, or recomputed the prompt", ["outcome"], registry=registry)  # fmt: skip


def adapter_label(digest: str | None) -> str:
    return digest[:12] if digest else "base"


def authorized(authorization: str) -> bool:
    token = settings.QUILT_METRICS_TOKEN
    return bool(token) and hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode())


def exposition() -> tuple[bytes, str]:
    return generate_latest(registry), CONTENT_TYPE_LATEST
