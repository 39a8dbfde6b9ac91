"""The gateway's Prometheus metrics, per process: requests, time to first token, latency, tokens and refusals by
tenant, model (as requested) and adapter (digest prefix, or "base"). Served at /metrics to a scraper that
presents `Authorization: Bearer $QUILT_METRICS_TOKEN`; with no token configured the endpoint does not exist
(tenant ids and model names are not for the public)."""

import hmac
from bisect import bisect_left

from django.conf import settings
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway.metric_counts import Counter, CounterValue, Histogram, HistogramValue

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


class RequestSeries:
    """The children of `requests`, `latency` and `tokens` for one (tenant, model, adapter), each looked up by
    `labels` on its first use, as the exchange did per request (so each series appears in the exposition when it
    did), and kept: a request's end is one call here, not six `labels` look-ups and five calls into the children."""

    __slots__ = ("labels", "outcomes", "latency", "tokens")

    def __init__(self, labels: tuple[str, str, str]):
        self.labels = labels
        self.outcomes: dict[str, CounterValue] = {}
        self.latency: HistogramValue | None = None
        self.tokens: tuple[CounterValue, CounterValue, CounterValue] | None = None

    def ended(self, outcome: str, seconds: float, prompt: int, cached: int, completion: int, *, counted: bool) -> None:
        """`requests` +1 for `outcome`, `seconds` into `latency`, and with `counted` (the engine's counts) the
        tokens of each kind: `inc` and `observe` written out (metric_counts' CounterValue and HistogramValue)."""
        request = self.outcomes.get(outcome)
        if request is None:
            request = self.outcomes[outcome] = requests.labels(*self.labels, outcome)
        request.value += 1
        histogram = self.latency
        if histogram is None:
            histogram = self.latency = latency.labels(*self.labels)
        histogram.sum += seconds
        histogram.counts[bisect_left(histogram.bounds, seconds)] += 1
        if not counted:
            return
        children = self.tokens
        if children is None or min(prompt, cached, completion) < 0:  # first use, or `inc` refuses a count
            self._count_tokens(prompt, cached, completion)
            return
        prompt_child, cached_child, completion_child = children
        prompt_child.value += prompt
        cached_child.value += cached
        completion_child.value += completion

    def _count_tokens(self, prompt: int, cached: int, completion: int) -> None:
        """One by one, as before: a negative count raises `inc`'s ValueError with the counts before it made."""
        prompt_child = tokens.labels(*self.labels, "prompt")
        prompt_child.inc(prompt)
        cached_child = tokens.labels(*self.labels, "cached")
        cached_child.inc(cached)
        completion_child = tokens.labels(*self.labels, "completion")
        completion_child.inc(completion)
        self.tokens = (prompt_child, cached_child, completion_child)


request_series: dict[tuple[str, str, str], RequestSeries] = {}  # by label values: as many as the children


def series_of(labels: tuple[str, str, str]) -> RequestSeries:
    series = request_series.get(labels)
    if series is None:
        series = request_series[labels] = RequestSeries(labels)
    return series


def adapter_label(digest: str | None) -> str:
    return digest[:12] if digest else "base"


def authorized(authorization: str) -> bool:
    token = settings.QUILT_METRICS_TOKEN
    return bool(token) and hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode())


def exposition() -> tuple[bytes, str]:
    return generate_latest(registry), CONTENT_TYPE_LATEST
