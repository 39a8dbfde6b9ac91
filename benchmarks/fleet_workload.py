"""What benchmarks/fleet_simulation.py simulates: the engine model (step and adapter-load times, fitted by
`python -m benchmarks.fleet_sim --calibrate`) and the traffic (Poisson arrivals, Zipf adapters or a hot spot,
shared system prompts per tenant)."""

import bisect
import dataclasses
import itertools
import random
from dataclasses import dataclass

from engine.contract import prompt_fingerprints

CHARS_PER_TOKEN = 4  # the fingerprints hash text; the engine model counts tokens


@dataclass(frozen=True)
class EngineModel:
    """Step and adapter-load times of one engine, in milliseconds."""

    step_base_ms: float
    per_token_ms: float
    per_seq_ms: float
    adapter_load_ms: float  # disk -> device: read from disk into host memory, then copied into device pages
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    adapter_slots: int = 64  # adapters resident in device memory at once
    host_load_ms: float = 2.0  # host -> device, the part of adapter_load_ms an adapter in host memory still pays
    host_slots: int = 256  # adapters kept in host memory (evicted from the device, or read and not yet placed)
    prefix_slots: int = 4096  # fingerprints remembered (the engine's RecentPrefixes)

    def faster(self, speedup: float) -> "EngineModel":
        return dataclasses.replace(self, step_base_ms=self.step_base_ms / speedup,
                                   per_token_ms=self.per_token_ms / speedup, per_seq_ms=self.per_seq_ms / speedup,
                                   adapter_load_ms=self.adapter_load_ms / speedup,
                                   host_load_ms=self.host_load_ms / speedup)

    def step_ms(self, tokens: int, seqs: int) -> float:
        return self.step_base_ms + self.per_token_ms * tokens + self.per_seq_ms * seqs


# Fitted by `--calibrate` on this machine: the demo model (hidden 128, 3 layers, rank-4/8 adapters read from disk),
# one torch thread, CPU time (2 cores shared with other sessions: wall time there ran 3x longer). Two runs gave base
# 0.77 / 1.01 ms, per token 0.030 / 0.029 ms, per sequence 0.051 / 0.057 ms, adapter load 10.0 / 14.8 ms
# (benchmarks/RESULTS.md).
CPU_MODEL = EngineModel(step_base_ms=0.9, per_token_ms=0.03, per_seq_ms=0.055, adapter_load_ms=12.0)


@dataclass(frozen=True)
class Workload:
    rate: float  # requests per second, Poisson
    duration_s: float
    adapters: int = 10_000
    zipf_s: float = 1.0
    tenants: int = 500  # adapter a belongs to tenant a % tenants; each tenant has one system prompt
    system_tokens: int = 128
    shared_prompt_share: float = 0.9  # requests that start with their tenant's system prompt
    user_tokens: tuple[int, int] = (16, 64)
    output_tokens: tuple[int, int] = (8, 48)
    hot_share: float = 0.0  # share of traffic on one adapter (the hot spot), the rest Zipf
    seed: int = 0


@dataclass
class Request:
    rid: int
    arrival: float
    adapter: str
    tenant: str
    fingerprints: list[str]
    system_tokens: int
    prompt_tokens: int
    output_tokens: int
    gateway: int = 0
    engine: int = -1
    first_token_at: float = -1.0


class Traffic:
    """Requests drawn from the workload: Zipf adapters (or a hot spot), shared system prompts per tenant."""

    def __init__(self, workload: Workload) -> None:
        self.w = workload
        self.rng = random.Random(workload.seed)
        weights = [1.0 / (k + 1) ** workload.zipf_s for k in range(workload.adapters)]
        self.cumulative = list(itertools.accumulate(weights))
        self.digests = [f"{k:064x}" for k in range(workload.adapters)]
        self._fingerprints: dict[int, list[str]] = {}
        self._system = {t: (f"tenant {t} system prompt. " * 200)[: workload.system_tokens * CHARS_PER_TOKEN]
                        for t in range(workload.tenants)}

    def adapter_index(self) -> int:
        if self.w.hot_share and self.rng.random() < self.w.hot_share:
            return 0
        return bisect.bisect_left(self.cumulative, self.rng.random() * self.cumulative[-1])

    def fingerprints(self, index: int) -> list[str]:
        found = self._fingerprints.get(index)
        if found is None:
            tenant = index % self.w.tenants
            found = self._fingerprints[index] = prompt_fingerprints(
                tenant=str(tenant), adapter=self.digests[index],
                messages=[{"role": "system", "content": self._system[tenant]}])  # fmt: skip
        return found

    def requests(self):
        t, rid, w = 0.0, 0, self.w
        while True:
            t += self.rng.expovariate(w.rate)
            if t >= w.duration_s:
                return
            index = self.adapter_index()
            shared = self.rng.random() < w.shared_prompt_share
            user = self.rng.randint(*w.user_tokens)
            system = w.system_tokens if shared else 0
            yield Request(rid=rid, arrival=t, adapter=self.digests[index], tenant=str(index % w.tenants),
                          fingerprints=self.fingerprints(index) if shared else [], system_tokens=system,
                          prompt_tokens=system + user, output_tokens=self.rng.randint(*w.output_tokens))
            rid += 1
