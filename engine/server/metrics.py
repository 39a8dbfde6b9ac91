"""Prometheus metrics of one engine process, in their own registry."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.adapter_pool import AdapterPool

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def adapter_label(digest: str | None) -> str:
    return "base" if digest is None else digest[:12]


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.step_seconds = Histogram("quilt_engine_step_seconds", "Time of one engine step",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("quilt_engine_batch_size", "Sequences in one step",
                                    buckets=SIZE_BUCKETS, registry=r)
        self.batch_tokens = Histogram("quilt_engine_batch_tokens", "Tokens computed in one step",
                                      buckets=SIZE_BUCKETS, registry=r)
        self.batch_adapters = Histogram("quilt_engine_batch_adapters", "Distinct adapters in one step",
                                        buckets=SIZE_BUCKETS[:8], registry=r)
        self.tokens = Counter("quilt_engine_tokens", "Tokens: prompt, cached (prefix hits), completion",
                              ["kind"], registry=r)
        self.tokens_per_second = Gauge("quilt_engine_tokens_per_second",
                                       "Generated tokens per second over the last few seconds", registry=r)
        self.steps_per_second = Gauge("quilt_engine_steps_per_second",
                                      "Engine steps per second over the last few seconds", registry=r)
        self.requests = Counter("quilt_engine_requests", "Requests ended, by finish reason",
                                ["tenant", "adapter", "finish_reason"], registry=r)
        self.ttft_seconds = Histogram("quilt_engine_ttft_seconds", "Time to a request's first token (once per request, whatever its n)",
                                      ["tenant", "adapter"], buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_seconds = Histogram(
            "quilt_engine_inter_token_seconds",
            "Time between output tokens, per token: k tokens that arrive together (one speculative step) after a "
            "gap g are k observations of g/k, so a request counts completion_tokens - 1 of them, summing to the "
            "time from its first token to its last",
            ["tenant", "adapter"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e_seconds = Histogram("quilt_engine_e2e_seconds", "Request time from arrival to end",
                                     ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("quilt_engine_queue_seconds", "Time waiting before first scheduled",
                                       ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("quilt_engine_running_requests", "Sequences running", registry=r)
        self.waiting = Gauge("quilt_engine_waiting_requests", "Sequences waiting", registry=r)
        self.kv_blocks_used = Gauge("quilt_engine_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_blocks_total = Gauge("quilt_engine_kv_blocks_total", "KV cache blocks in all", registry=r)
        self.kv_usage = Gauge("quilt_engine_kv_usage_ratio", "Fraction of KV cache blocks in use", registry=r)
        self.prefix_hit_rate = Gauge("quilt_engine_prefix_cache_hit_rate", "Prefix cache hit rate", registry=r)
        self.adapter_requests = Counter("quilt_engine_adapter_requests",
                                        "Requests for an adapter, by the tier it was found in (gpu/host: hit)",
                                        ["adapter", "tier"], registry=r)
        self.adapter_loads = Counter("quilt_engine_adapter_loads", "Adapters loaded into a tier",
                                     ["tier"], registry=r)
        self.adapter_evictions = Counter("quilt_engine_adapter_evictions", "Adapters evicted from a tier",
                                         ["tier"], registry=r)
        self.adapters_resident = Gauge("quilt_engine_adapters_resident", "Adapters resident per tier",
                                       ["tier"], registry=r)
        self.memory_bytes = Gauge("quilt_engine_memory_bytes",
                                  "Engine memory by use: base_weights, kv_pages, adapter_pages, free (pages)",
                                  ["kind"], registry=r)
        self.spec_tokens = Counter("quilt_engine_spec_tokens",
                                   "Speculative decoding: tokens proposed and accepted", ["kind"], registry=r)
        self.spec_acceptance = Gauge("quilt_engine_spec_acceptance_rate",
                                     "Speculative decoding: accepted / proposed tokens since start", registry=r)
        self.tokens_per_step = Gauge("quilt_engine_tokens_per_step",
                                     "Tokens a sequence gets per step it samples in, since start (1 without "
                                     "speculation)", registry=r)
        self._spec_seen = {"proposed": 0, "accepted": 0}
        self.adapter_downloads = Counter("quilt_engine_adapter_downloads",
                                         "Adapter downloads through signed URLs, by outcome (ok, failed)",
                                         ["outcome"], registry=r)
        self.adapter_disk_cache_bytes = Gauge("quilt_engine_adapter_disk_cache_bytes",
                                              "Bytes of downloaded adapters on local disk, in flight included",
                                              registry=r)
        self._downloads_seen = {"ok": 0, "failed": 0}
        # disaggregated serving (docs/kv-tiers.md)
        self.kv_pulls = Counter("quilt_engine_kv_pulls", "Decode hops' KV pulls, by outcome: ok, or recomputed (some "
                                "leased blocks were computed here instead), and how the blocks came (nixl, shm, "
                                "tcp; none: nothing pulled)", ["outcome", "via"], registry=r)
        self.kv_recomputes = Counter("quilt_engine_kv_recomputes",
                                     "KV pulls that fell back to recomputing, by reason (timeout, closed, "
                                     "unknown_lease, expired, pulled, protocol, payload, not_leased, mismatch, no_room, "
                                     "bad_lease)",
                                     ["reason"], registry=r)
        self.kv_transfer_blocks = Counter("quilt_engine_kv_transfer_blocks", "KV blocks sent to and received from "
                                          "other engines", ["direction"], registry=r)
        self.kv_leases = Gauge("quilt_engine_kv_leases", "KV leases held for other engines", registry=r)
        self.kv_leased_blocks = Gauge("quilt_engine_kv_leased_blocks", "KV blocks held by leases", registry=r)
        self.kv_leases_released = Counter("quilt_engine_kv_leases_released",
                                          "KV leases ended, by reason (done, released, closed, expired, drain, evicted)",
                                          ["reason"], registry=r)
        self._leases_seen: dict[str, int] = {}
        self.kv_tier_blocks = Counter("quilt_engine_kv_tier_lookups",
                                      "Prompt KV blocks looked up at admission, by tier (device, host) and result "
                                      "(hit, miss); a host lookup is a device miss", ["tier", "result"], registry=r)
        self.kv_tier_resident = Gauge("quilt_engine_kv_tier_blocks", "Prefix KV blocks held per tier", ["tier"],
                                      registry=r)
        self._kv_seen: dict[tuple[str, str], int] = {}
        # per-adapter residency (docs/engine-memory.md): one series per adapter in each memory tier, so the
        # cardinality is bounded by memory; an outside router reads which engine holds what
        self.adapter_resident = Gauge("quilt_engine_adapter_resident",
                                      "1 for each adapter in a memory tier (device, host); pinned: pinned always-warm "
                                      "in this tier, never evicted from it; rank: its largest module rank",
                                      ["adapter", "tier", "pinned", "rank"], registry=r)
        self._resident_seen: set[tuple[str, str, str, str]] = set()
        self.adapter_load_seconds = Histogram("quilt_engine_adapter_load_seconds",
                                              "Time an adapter took to move between tiers: disk -> host (read, "
                                              "checked, laid out), host -> device (copied into pages)",
                                              ["from_tier", "to_tier"], buckets=LATENCY_BUCKETS, registry=r)
        self.adapter_wait_seconds = Histogram("quilt_engine_adapter_wait_seconds",
                                              "Time a request with an adapter waited for it to be in memory (0 when "
                                              "it was; until its load failed when it did)",
                                              buckets=(0.0,) + LATENCY_BUCKETS, registry=r)
        self.usage_spooled = Gauge("quilt_engine_usage_events_spooled",
                                   "Usage events spooled to disk while the broker was unreachable", registry=r)

    def observe_state(self, state: dict) -> None:
        self.running.set(state["running"])
        self.waiting.set(state["waiting"])
        total = state["kv_blocks_total"]
        self.kv_blocks_used.set(state["kv_blocks_used"])
        self.kv_blocks_total.set(total)
        self.kv_usage.set(state["kv_blocks_used"] / total if total else 0.0)
        self.prefix_hit_rate.set(state["prefix_cache_hit_rate"])
        self.adapters_resident.labels(tier="gpu").set(len(state["adapters"]["gpu"]))
        memory = state["memory"]
        for kind in ("base_weights", "kv_pages", "adapter_pages", "free"):
            self.memory_bytes.labels(kind=kind).set(memory[f"{kind}_bytes"])
        self.adapters_resident.labels(tier="host").set(len(state["adapters"]["host"]))
        self._observe_kv_tiers(state["kv_tiers"])
        spec = state.get("speculation")
        if spec is not None:
            for kind in ("proposed", "accepted"):  # the engine keeps totals: the counter takes what is new
                total = spec[f"{kind}_tokens"]
                self.spec_tokens.labels(kind=kind).inc(max(0, total - self._spec_seen[kind]))
                self._spec_seen[kind] = total
            self.spec_acceptance.set(spec["acceptance_rate"])
            self.tokens_per_step.set(spec["tokens_per_step"])

    def observe_adapters(self, pool: AdapterPool) -> None:
        """The pool's residency now (when scraped: it walks every adapter in memory), and its moves."""
        now = {(adapter_label(r.digest), r.tier, str(r.pinned).lower(), str(r.rank)) for r in pool.residency()}
        for labels in self._resident_seen - now:
            self.adapter_resident.remove(*labels)
        for labels in now - self._resident_seen:
            self.adapter_resident.labels(*labels).set(1)
        self._resident_seen = now
        self.observe_adapter_loads(pool)

    def observe_adapter_loads(self, pool: AdapterPool) -> None:
        """The moves between tiers the pool finished since the last call (each step: the pool keeps a bounded few)."""
        for move in pool.take_load_times():
            self.adapter_load_seconds.labels(from_tier=move.from_tier, to_tier=move.to_tier).observe(move.seconds)

    def observe_leases(self, leases: dict) -> None:
        """engine.kv.lease.LeaseTable.state(): the table keeps totals, the counter takes what is new."""
        self.kv_leases.set(leases["active"])
        self.kv_leased_blocks.set(leases["held_blocks"])
        for reason, total in leases["released"].items():
            self.kv_leases_released.labels(reason=reason).inc(max(0, total - self._leases_seen.get(reason, 0)))
            self._leases_seen[reason] = total

    def _observe_kv_tiers(self, tiers: dict) -> None:
        for tier, counts in tiers.items():
            self.kv_tier_resident.labels(tier=tier).set(counts["blocks"])
            for result, field in (("hit", "hits"), ("miss", "misses")):  # totals: the counter takes what is new
                seen = self._kv_seen.get((tier, result), 0)
                self.kv_tier_blocks.labels(tier=tier, result=result).inc(max(0, counts[field] - seen))
                self._kv_seen[(tier, result)] = counts[field]

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_downloads(self, downloads: dict[str, int], *, disk_cache_bytes: int) -> None:
        """The fetcher's counts of finished downloads, and its cache's bytes (engine.server.adapter_fetch)."""
        for outcome, count in downloads.items():
            self.adapter_downloads.labels(outcome=outcome).inc(count - self._downloads_seen[outcome])
            self._downloads_seen[outcome] = count
        self.adapter_disk_cache_bytes.set(disk_cache_bytes)
