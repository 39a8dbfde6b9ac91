"""The gateway's Prometheus metrics, per process: requests, time to first token, latency, tokens and refusals by
tenant, model (as requested) and adapter (digest prefix, or "base"). Served at /metrics to a scraper that
presents `Authorization: Bearer $QUILT_METRICS_TOKEN`; with no token configured the endpoint does not exist
(tenant ids and model names are not for the public)."""

import hmac

from django.conf import settings
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

registry = CollectorRegistry()
LABELS = ("tenant", "model", "adapter")
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

requests = Counter("quilt_gateway_requests", "Admitted inference requests by how they ended", [*LABELS, "outcome"],
                   registry=registry)  # fmt: skip
refusals = Counter("quilt_gateway_refusals", "Requests refused by admission, by reason", ["tenant", "reason"],
                   registry=registry)  # fmt: skip
settle_failures = Counter("quilt_gateway_settle_failures", "Holds whose settle failed because admission's store "
                          "(Redis, or the database) was down: the answer ended as served; metering's settle of the "
                          "engine's usage event releases the hold, else its TTL", ["tenant"], registry=registry)  # fmt: skip
admission_leases = Counter("quilt_gateway_admission_leases", "Admission leases taken: shares of a tenant's key's "
                           "limits held ahead, its requests admitted in the process (gateway.admission.leases)",
                           ["tenant"], registry=registry)  # fmt: skip
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


_ended: dict[tuple, tuple] = {}  # labelled children by (labels, outcome): `labels()` takes a lock and builds a key
_counted: dict[tuple, tuple] = {}  # the token children by labels, made when the engine first counts


def request_ended(labels: tuple[str, str, str], outcome: str, seconds: float, prompt: int, cached: int,
                  completion: int, *, counted: bool) -> None:
    """A request's end: `requests` +1 for `outcome`, `seconds` into `latency`, and with `counted` (the engine's
    counts) the tokens of each kind."""
    children = _ended.get((labels, outcome))
    if children is None:
        children = _ended[(labels, outcome)] = (requests.labels(*labels, outcome), latency.labels(*labels))
    children[0].inc()
    children[1].observe(seconds)
    if counted:
        kinds = _counted.get(labels)
        if kinds is None:
            kinds = _counted[labels] = tuple(tokens.labels(*labels, kind) for kind in ("prompt", "cached", "completion"))
        kinds[0].inc(prompt)
        kinds[1].inc(cached)
        kinds[2].inc(completion)


def adapter_label(digest: str | None) -> str:
    return digest[:12] if digest else "base"


def authorized(authorization: str) -> bool:
    token = settings.QUILT_METRICS_TOKEN
    return bool(token) and hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode())


def exposition() -> tuple[bytes, str]:
    return generate_latest(registry), CONTENT_TYPE_LATEST
