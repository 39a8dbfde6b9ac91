"""The fleet simulator: engines simulated in outline, routed by the gateway's real routing function
(`gateway.route_score.choose`, imported, not copied) from several gateway processes, each with its own view.

The simulated engine is Quilt's engine in outline: continuous batching under a token budget per step
(max_num_batched_tokens) and a sequence cap (max_num_seqs); a waiting request whose adapter is not in device memory
triggers a load on the engine's one loader thread and waits while others run; resident adapters are evicted least
recently used among those no running request holds, into host memory (bounded, least recently used out); a prompt's
shared system prompt is a prefix-cache hit where the engine served it lately. Step time = base + per_token × tokens
in the step + per_seq × sequences in the step; an adapter load takes adapter_load_ms from disk, host_load_ms from
host memory (benchmarks/fleet_workload.py's EngineModel). Engines heartbeat every 2 s with their tiers, their load
times and the mean time a request held a slot; each of the gateway processes re-reads the heartbeats once a second
and adds the requests it sent since, exactly as `gateway.routing.Router` does.
"""

import collections
import dataclasses
import heapq
import itertools
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "platform"))  # the gateway's modules, without Django: route_score imports none

from benchmarks.fleet_workload import EngineModel, Request, Traffic, Workload  # noqa: E402
from gateway.route_score import DEFAULT, FIXED, Candidate, Fleet, Loads, Weights, choose  # noqa: E402

HEARTBEAT_S = 2.0
SNAPSHOT_S = 1.0
REQUEST_MEAN_WEIGHT = 0.05  # each finished request's share of the engine's running mean of request_seconds


class SimEngine:
    def __init__(self, index: int, model: EngineModel) -> None:
        self.index, self.name, self.m = index, f"engine-{index:03d}", model
        self.waiting: collections.deque[Request] = collections.deque()
        self.running = 0
        self.decoding: list[tuple[int, int, Request]] = []  # (step it finishes on, rid, request)
        self.step_no = 0
        self.busy = False
        self.resident: collections.OrderedDict[str, int] = collections.OrderedDict()  # digest -> running users
        self.loading: dict[str, float] = {}  # digest -> ready time
        self.host: collections.OrderedDict[str, None] = collections.OrderedDict()  # in host memory, LRU first
        self.request_seconds: float | None = None  # running mean of first token -> finish
        self.loader_free_at = 0.0
        self.prefixes: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.adapter_loads = 0
        self.load_time_area = 0.0  # integral of (running + waiting) dt
        self._last_change = 0.0

    def load(self) -> int:
        return self.running + len(self.waiting)

    def account(self, now: float) -> None:
        self.load_time_area += self.load() * (now - self._last_change)
        self._last_change = now

    def heartbeat(self) -> Candidate:
        m = self.m
        return Candidate(
            name=self.name, capacity=m.max_num_seqs, load=self.load(), kv_usage=min(1.0, self.running / m.max_num_seqs),
            adapter_free=max(0.0, 1.0 - len(self.resident) / m.adapter_slots),
            resident=frozenset(self.resident), loading=frozenset(self.loading), host=frozenset(self.host),
            load_seconds=((m.adapter_load_ms - m.host_load_ms) / 1000.0, m.host_load_ms / 1000.0),
            request_seconds=self.request_seconds, prefixes=frozenset(itertools.islice(reversed(self.prefixes), 512)),
        )  # fmt: skip

    def finished(self, request: Request, now: float) -> None:
        seconds = now - request.first_token_at
        mean = self.request_seconds
        self.request_seconds = seconds if mean is None else mean + REQUEST_MEAN_WEIGHT * (seconds - mean)


class Simulation:
    """One run: a workload against `engines` simulated engines through `gateways` routing processes."""

    def __init__(self, *, policy: str, workload: Workload, engines: int, model: EngineModel, gateways: int = 4,
                 weights: Weights = DEFAULT) -> None:
        self.policy, self.workload, self.model = policy, workload, model
        self.engines = [SimEngine(i, model) for i in range(engines)]
        self.gateways = gateways
        self.weights = {"least-load": Weights(affinity=False), "affinity-only": Weights(bounded=False),
                        "fixed": dataclasses.replace(FIXED, spill_ratio=weights.spill_ratio,
                                                     spill_gap=weights.spill_gap, spill_step=weights.spill_step),
                        "full": weights}.get(policy)  # fmt: skip
        self.events: list = []
        self.seq = itertools.count()
        self.ttft: list[float] = []
        self.decisions_ns: list[int] = []  # wall time of each decision (includes being descheduled)
        self.decisions_cpu_ns: list[int] = []  # this thread's CPU time in it
        self.prompt_tokens = self.cached_tokens = self.shared_tokens = 0
        self.beats = [e.heartbeat() for e in self.engines]
        self.fleets: list[Fleet] = []
        self.in_flight = [[0] * engines for _ in range(gateways)]  # per gateway: requests it sent, not yet ended
        self.loads: list[Loads] = []
        self.round_robin = [g for g in range(gateways)]

    def at(self, when: float, kind: str, *payload) -> None:
        heapq.heappush(self.events, (when, next(self.seq), kind, payload))

    # gateway side
    def snapshot(self) -> None:
        self.fleets = [Fleet(self.beats, weights=self.weights) if self.weights else None for _ in range(self.gateways)]
        reported = [beat.load for beat in self.beats]
        self.loads = [Loads(reported, row) for row in self.in_flight]

    def route(self, request: Request) -> int:
        g = request.gateway
        if self.policy == "round-robin":
            self.round_robin[g] = (self.round_robin[g] + 1) % len(self.engines)
            return self.round_robin[g]
        fleet, loads = self.fleets[g], self.loads[g]
        started, cpu = time.perf_counter_ns(), time.thread_time_ns()
        index = choose(fleet, adapter=request.adapter, fingerprints=request.fingerprints, loads=loads.values,
                       step=loads.step)
        fleet.served(index, adapter=request.adapter, fingerprints=request.fingerprints)
        loads.started(index)
        self.decisions_cpu_ns.append(time.thread_time_ns() - cpu)
        self.decisions_ns.append(time.perf_counter_ns() - started)
        return index

    # engine side
    def arrive(self, now: float, request: Request) -> None:
        index = self.route(request)
        request.engine = index
        self.in_flight[request.gateway][index] += 1
        engine = self.engines[index]
        engine.account(now)
        engine.waiting.append(request)
        if request.adapter not in engine.resident and request.adapter not in engine.loading:
            self.start_load(now, engine, request.adapter)
        if not engine.busy:
            self.step(now, engine)

    def start_load(self, now: float, engine: SimEngine, digest: str) -> None:
        in_host = digest in engine.host
        engine.host.pop(digest, None)
        seconds = (self.model.host_load_ms if in_host else self.model.adapter_load_ms) / 1000.0
        ready = max(now, engine.loader_free_at) + seconds
        engine.loader_free_at = ready
        engine.loading[digest] = ready
        engine.adapter_loads += 1
        self.at(ready, "loaded", engine, digest)

    def loaded(self, now: float, engine: SimEngine, digest: str) -> None:
        engine.loading.pop(digest, None)
        engine.resident[digest] = engine.resident.get(digest, 0)
        engine.resident.move_to_end(digest)
        while len(engine.resident) > self.model.adapter_slots:
            idle = next((d for d, users in engine.resident.items() if users == 0 and d != digest), None)
            if idle is None:
                break
            del engine.resident[idle]
            engine.host[idle] = None
            while len(engine.host) > self.model.host_slots:
                engine.host.popitem(last=False)
        if not engine.busy:
            self.step(now, engine)

    def step(self, now: float, engine: SimEngine) -> None:
        """Schedules one step: running decodes plus the waiting requests (resident adapter) that fit."""
        m = self.model
        budget = m.max_num_batched_tokens - engine.running
        admitted, skipped = [], []
        while engine.waiting and engine.running + len(admitted) < m.max_num_seqs and budget > 0:
            request = engine.waiting.popleft()
            if request.adapter not in engine.resident:
                if request.adapter not in engine.loading:
                    self.start_load(now, engine, request.adapter)
                skipped.append(request)
                continue
            cached = request.system_tokens if request.fingerprints and request.fingerprints[-1] in engine.prefixes else 0
            tokens = request.prompt_tokens - cached
            if tokens > budget and admitted:
                engine.waiting.appendleft(request)
                break
            budget -= tokens
            self.prompt_tokens += request.prompt_tokens
            self.cached_tokens += cached
            self.shared_tokens += request.system_tokens
            admitted.append(request)
        engine.waiting.extendleft(reversed(skipped))
        if not admitted and not engine.running:
            engine.busy = False
            return
        tokens = m.max_num_batched_tokens - budget  # running decodes + the prefills admitted
        engine.busy = True
        self.at(now + m.step_ms(tokens, engine.running + len(admitted)) / 1000.0, "stepped", engine, admitted)

    def stepped(self, now: float, engine: SimEngine, admitted: list[Request]) -> None:
        engine.account(now)
        engine.step_no += 1
        while engine.decoding and engine.decoding[0][0] <= engine.step_no:
            _, _, request = heapq.heappop(engine.decoding)
            self.finish(engine, request, now)
        for request in admitted:
            engine.running += 1
            engine.resident[request.adapter] = engine.resident.get(request.adapter, 0) + 1
            engine.resident.move_to_end(request.adapter)
            for fingerprint in request.fingerprints:
                engine.prefixes[fingerprint] = None
                engine.prefixes.move_to_end(fingerprint)
            while len(engine.prefixes) > self.model.prefix_slots:
                engine.prefixes.popitem(last=False)
            request.first_token_at = now
            self.ttft.append(now - request.arrival)
            if request.output_tokens <= 1:
                self.finish(engine, request, now)
            else:
                heapq.heappush(engine.decoding, (engine.step_no + request.output_tokens - 1, request.rid, request))
        self.step(now, engine)

    def finish(self, engine: SimEngine, request: Request, now: float) -> None:
        engine.finished(request, now)
        engine.running -= 1
        if request.adapter in engine.resident:
            engine.resident[request.adapter] -= 1
        self.in_flight[request.gateway][request.engine] -= 1
        if self.policy != "round-robin":
            self.loads[request.gateway].ended(request.engine)

    def heartbeat(self, now: float, engine: SimEngine) -> None:
        self.beats[engine.index] = engine.heartbeat()
        self.at(now + HEARTBEAT_S, "heartbeat", engine)

    def run(self) -> dict:
        w = self.workload
        for i, engine in enumerate(self.engines):
            self.at(HEARTBEAT_S * i / len(self.engines), "heartbeat", engine)  # staggered, as real engines start
        self.snapshot()
        for tick in range(1, int(w.duration_s / SNAPSHOT_S) + 2):
            self.at(tick * SNAPSHOT_S, "snapshot")
        traffic = Traffic(w).requests()
        pending = next(traffic, None)
        end = w.duration_s
        while self.events or pending is not None:
            if pending is not None and (not self.events or pending.arrival <= self.events[0][0]):
                now, request = pending.arrival, pending
                request.gateway = request.rid % self.gateways
                pending = next(traffic, None)
                self.arrive(now, request)
                continue
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "stepped":
                self.stepped(now, *payload)
            elif kind == "loaded":
                self.loaded(now, *payload)
            elif kind == "heartbeat":
                if now < end:
                    self.heartbeat(now, *payload)
            elif kind == "snapshot":
                if now <= end:
                    self.snapshot()
        return self.report(end)

    def report(self, end: float) -> dict:
        for engine in self.engines:
            engine.account(max(end, engine._last_change))
        loads = [e.load_time_area / end for e in self.engines]
        mean_load = statistics.fmean(loads)
        ttft = sorted(self.ttft)
        decisions, cpu = sorted(self.decisions_ns), sorted(self.decisions_cpu_ns)
        return {
            "policy": self.policy, "requests": len(ttft),
            "ttft_p50_ms": percentile(ttft, 50) * 1000, "ttft_p99_ms": percentile(ttft, 99) * 1000,
            "adapter_loads_per_s": sum(e.adapter_loads for e in self.engines) / end,
            "prefix_hit_rate": self.cached_tokens / self.shared_tokens if self.shared_tokens else 0.0,
            "busiest_over_mean": max(loads) / mean_load if mean_load else 0.0,
            "decision_p50_us": percentile(decisions, 50) / 1000 if decisions else 0.0,
            "decision_p99_us": percentile(decisions, 99) / 1000 if decisions else 0.0,
            "decision_cpu_p50_us": percentile(cpu, 50) / 1000 if cpu else 0.0,
            "decision_cpu_p99_us": percentile(cpu, 99) / 1000 if cpu else 0.0,
        }  # fmt: skip


def percentile(ordered: list, q: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]

