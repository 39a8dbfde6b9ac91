"""Routing's one scoring function: which engine serves a request. Pure Python over plain data (no Django, no
database, no clock), so that every gateway process decides the same way and `benchmarks/fleet_sim.py` drives
this very code. The rule, in words (docs/routing.md has the why):

    load[i]   = running + waiting requests on engine i (its heartbeat, plus what this process sent since)
    bound     = max((1 + SPILL_RATIO) * mean(load), mean(load) + SPILL_GAP)      # bounded-load hashing
    score[i]  = - LOAD * load[i] / capacity[i] - KV * kv_usage[i]
                + (if load[i] <= bound)  affinity[i] + PREFIX * matched_chunks[i] / chunks + HASH * rendezvous[i]
    choose      argmax score, ties to the lower index

The adapter's term, `affinity`, is its expected load time on engine i, in the load term's units (Weights.cost: COST,
the gateway's DEFAULT). The load term becomes a queue wait in seconds: load[i] / capacity[i] requests ahead per slot, each
request_seconds[i] long (the mean time a request holds a slot there). One second of expected TTFT scores
LOAD / mean(request_seconds) over the fleet, so that on a fleet of equal engines the load term is the one above:

    load term = - LOAD * load[i] / capacity[i] * request_seconds[i] / mean(request_seconds)
    affinity  = - LOAD / mean(request_seconds) * load_time[i][tier of the adapter on engine i]
    load_time = device: 0;  host: host -> device;  loading: host -> device + half of disk -> host;
                disk or absent: disk -> host + host -> device
                (not more on an engine whose page pool is full: every process reads the same heartbeat, seconds
                old, and a slow load weighed more there sent every cold adapter to the engine that looked emptiest)

`load_time` is each engine's own mean of its measured moves (its heartbeat's adapters.load_seconds, what
quilt_engine_adapter_load_seconds{from_tier,to_tier} observes), else Weights' defaults. An engine that holds the
adapter scores HASH in place of its rendezvous term, the most that term gives: the rendezvous term still sends a cold
adapter to the same few engines from every gateway process (benchmarks/fleet_sim.py: with it only breaking ties,
the processes load one adapter on different engines, and TTFT p99 triples), but never ranks an engine that lacks
the adapter above one that holds it at an equal cost. So an engine that holds the adapter wins while its extra
queue wait is under the load time another engine would need (up to HASH's worth of seconds), and loses past that.
With `cost=False` (the fixed weights, kept for comparison in benchmarks/fleet_sim.py):

    affinity  = RESIDENT if the adapter is in device memory, LOADING if it is being loaded or sits in host memory,
                else FREE * the engine's free share of its page pool (room to load it without evicting), else 0

An engine past the bound keeps its load terms but loses its affinity and prefix bonus: a hot adapter spills to the
next engine as soon as its favourite's queue runs ahead of the fleet, and warms there, so it spreads over as many
engines as its load needs. `rendezvous` is a stable per-(adapter, engine) number in [0, 1): a cold adapter goes to
the same few engines from every gateway process.

Disaggregated prefill/decode (`choose_route`, docs/kv-tiers.md): on a fleet where some engine has a role other
than "both", the engine that serves the request (decodes) is chosen by `choose` among the engines that are not
prefill-only; if the prompt's part not cached there is long, a prefill engine is chosen by `choose` too, among the
prefill engines (else the "both" ones), and computes the prompt's KV first.
"""

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import add, mul, sub
from typing import NamedTuple

from engine.contract import PREFIX_CHUNK_CHARS, EngineState, prompt_fingerprints
from engine.contract.state import ROLES

__all__ = [
    "COST", "DEFAULT", "FIXED", "ROLES", "Candidate", "Fleet", "Route", "Weights", "candidate_from_state", "Loads", "choose",
    "choose_route", "prompt_fingerprints", "uncached_tokens",
]

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio (Fibonacci hashing)
CACHED_KEYS = 4096  # per snapshot: the rendezvous terms of this many adapters (or prompts) kept between decisions
TIE_BREAK = 1e-3  # without affinity, equal loads still split by the request's hash, not all to the first engine
CHARS_PER_TOKEN = 4  # the gateway does not tokenize: English BPE averages about 4 characters a token
_EXCLUDED = -math.inf  # an excluded engine's score
_UNBOUNDED = math.inf


@dataclass(frozen=True, slots=True)
class Weights:
    resident: float = 4.0
    loading: float = 3.0
    free: float = 1.0  # FIXED's bonus per free share of the page pool (the cost score does not weigh it)
    prefix: float = 2.0
    hash: float = 0.5
    load: float = 2.0
    kv: float = 1.0
    spill_ratio: float = 0.1  # chosen in benchmarks/fleet_sim.py (RESULTS.md): the hot spot's busiest/mean <= 1.5
    spill_gap: float = 0.25
    spill_step: float = 0.5
    affinity: bool = True  # False: no adapter, prefix or rendezvous terms (least-load)
    prefixes: bool = True
    bounded: bool = True  # False: affinity whatever the queue (affinity-only)
    cost: bool = True  # the adapter's term is its expected load time on each engine; False: RESIDENT / LOADING / FREE
    # for an engine whose heartbeat does not say: the seconds a request holds a slot, and an adapter's moves
    request_seconds: float = 2.0
    disk_host_seconds: float = 0.2
    host_device_seconds: float = 0.02


COST = Weights()  # the adapter's expected load time on each engine against its queue
FIXED = Weights(cost=False)  # constant affinity bonuses, whatever an engine's load times
DEFAULT = COST  # the gateway's
DEVICE, HOST, LOADING = 0, 1, 2  # an adapter's tier on an engine that holds it (Fleet.adapters)


@dataclass(frozen=True, slots=True)
class Candidate:
    """What the router knows of one engine, from its last heartbeat."""

    name: str
    capacity: int = 1  # requests it runs at once (max_num_seqs)
    load: int = 0  # running + waiting
    kv_usage: float = 0.0  # share of KV pages in use, 0..1
    adapter_free: float = 1.0  # share of the page pool free, 0..1
    resident: frozenset[str] = frozenset()  # adapter digests in device memory
    loading: frozenset[str] = frozenset()  # being read from disk into host memory
    host: frozenset[str] = frozenset()  # in host memory (one copy from device)
    load_seconds: tuple[float | None, float | None] = (None, None)  # measured means: disk -> host, host -> device
    request_seconds: float | None = None  # measured mean time a request holds a slot
    prefixes: frozenset[str] = frozenset()  # prompt fingerprints it served recently (prompt_fingerprints)
    role: str = "both"  # "prefill", "decode" or "both" (ROLES)


@dataclass(slots=True)
class Fleet:
    """A snapshot's engines, indexed once for the many decisions made on it."""

    candidates: Sequence[Candidate]
    names: list[str] = field(init=False)
    static: list[float] = field(init=False)  # the terms that do not depend on the request
    load_per_request: list[float] = field(init=False)
    free: list[float] = field(init=False)  # the adapter term of an engine that lacks the adapter
    held: list[tuple[float, float, float]] = field(init=False)  # ... of one that holds it: device, host, loading
    past_bound: list[float] = field(init=False)  # an adapter request's terms on an engine past the load bound
    seeds: list[int] = field(init=False)
    adapters: dict[str, dict[int, int]] = field(init=False)  # digest -> engine index -> DEVICE, HOST or LOADING
    prefix_index: dict[str, list[int]] = field(init=False)  # fingerprint -> engine indexes
    roles: list[str] = field(init=False)
    split: bool = field(init=False)  # some engine is prefill- or decode-only: the fleet disaggregates
    alone: bool = field(init=False)  # one engine, every term finite: it serves whatever the scores (`choose`)
    weights: Weights = DEFAULT
    _keys: dict[str, int] = field(init=False, default_factory=dict)
    _within: dict[tuple[int, bool], list[float]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        w = self.weights
        self.names = [c.name for c in self.candidates]
        self.static = [-w.kv * c.kv_usage for c in self.candidates]
        self.load_per_request = [w.load / max(1, c.capacity) for c in self.candidates]
        if w.cost and self.candidates:
            seconds = [c.request_seconds or w.request_seconds for c in self.candidates]
            per_second = w.load * len(seconds) / sum(seconds)  # the score of one second of expected TTFT
            self.load_per_request = [per_second * held / max(1, c.capacity)
                                     for held, c in zip(seconds, self.candidates, strict=True)]
            self.free, self.held = [], []
            for c in self.candidates:
                disk_host, host_device = c.load_seconds
                disk = per_second * (w.disk_host_seconds if disk_host is None else disk_host)
                host = per_second * (w.host_device_seconds if host_device is None else host_device)
                self.free.append(-(disk + host))
                self.held.append((0.0, -host, -host - disk / 2))
        else:
            self.free = [w.free * c.adapter_free for c in self.candidates]
            self.held = [(w.resident, w.loading, w.loading)] * len(self.candidates)
        # past the bound an engine loses its affinity: with costs, it is scored as if it lacked the adapter
        self.past_bound = [*map(add, self.static, self.free)] if w.cost else self.static
        self.seeds = [_stable_int(c.name) for c in self.candidates]
        self.roles = [c.role for c in self.candidates]
        self.split = any(role != "both" for role in self.roles)
        terms = [*self.static, *self.load_per_request, *self.free, *(t for held in self.held for t in held),
                 w.prefix, w.hash, w.load]
        self.alone = len(self.candidates) == 1 and all(map(math.isfinite, terms))
        self.adapters = {}
        self.prefix_index = {}
        for i, c in enumerate(self.candidates):
            for tier, digests in ((LOADING, c.loading), (HOST, c.host), (DEVICE, c.resident)):  # the nearest wins
                for digest in digests:
                    self.adapters.setdefault(digest, {})[i] = tier
            for fingerprint in c.prefixes:
                self.prefix_index.setdefault(fingerprint, []).append(i)

    def key(self, text: str) -> int:
        key = self._keys.get(text)
        if key is None:
            if len(self._keys) >= CACHED_KEYS:
                self._keys.clear()
            key = self._keys[text] = _stable_int(text)
        return key

    def within(self, key: int, *, free: bool) -> list[float]:
        """The request-independent terms plus, for a request keyed `key`, the rendezvous term (and the free-memory
        term for an adapter request): what an engine under the load bound scores before affinity, prefix and load."""
        cached = self._within.get((key, free))
        if cached is None:
            w = self.weights
            weight = (w.hash if w.affinity else TIE_BREAK) / 16777216.0
            cached = [base + (room if free else 0.0) + weight * ((((seed ^ key) * _MIX) >> 40) & 0xFFFFFF)
                      for base, room, seed in zip(self.static, self.free, self.seeds, strict=True)]
            if len(self._within) >= CACHED_KEYS:
                self._within.clear()
            self._within[(key, free)] = cached
        return cached

    def with_role(self, *roles: str) -> set[int]:
        return {i for i, role in enumerate(self.roles) if role in roles}

    def matched_chunks(self, index: int, fingerprints: Sequence[str]) -> int:
        """How many leading chunks of the prompt engine `index` served lately (its prefix summary; the fingerprints
        are chained, so the deepest one it holds says the whole prefix up to there)."""
        depth = 0
        for k, fingerprint in enumerate(fingerprints, 1):
            if index in self.prefix_index.get(fingerprint, ()):
                depth = k
        return depth

    def base_loads(self) -> list[int]:
        return [c.load for c in self.candidates]

    def served(self, index: int, *, adapter: str | None, fingerprints: Sequence[str]) -> None:
        """What this process just sent engine `index`: until the next heartbeat says more, the adapter counts as
        loading there and the prompt's prefix as cached there."""
        if adapter is not None:
            self.adapters.setdefault(adapter, {}).setdefault(index, LOADING)
        for fingerprint in fingerprints:
            engines = self.prefix_index.setdefault(fingerprint, [])
            if index not in engines:
                engines.append(index)


def candidate_from_state(name: str, state: EngineState) -> Candidate:
    """A Candidate from an engine's state (its heartbeat's, or a static engine's /v1/state answer)."""
    adapters, total = state.adapters, state.kv_blocks_total
    return Candidate(
        name=name, capacity=state.capacity, load=state.load,
        kv_usage=state.kv_blocks_used / total if total else 0.0,
        adapter_free=state.kv_blocks_free / total if total else 1.0,  # adapter pages and KV blocks share one pool
        resident=frozenset(adapters.gpu), loading=frozenset(adapters.loading), host=frozenset(adapters.host),
        load_seconds=(_measured(adapters.load_seconds.disk_host), _measured(adapters.load_seconds.host_device)),
        request_seconds=_measured(state.request_seconds), prefixes=frozenset(state.prefixes), role=state.role,
    )  # fmt: skip


def _measured(seconds: float | None) -> float | None:
    """A measured time, or None (Weights' default stands in) for one that is absent, not positive or not finite."""
    return seconds if seconds is not None and 0 < seconds < math.inf else None


class Loads:
    """Each engine's load now, as one gateway process can know it, kept up to date in O(1) per request. The
    heartbeats say what every process had sent, but seconds ago, and requests last a fraction of that; this process's
    own count of requests in flight is live, but only its share. Their ratio over the fleet at the snapshot,
    R = max(1, sum(reported) / sum(in flight here)), is how many processes' worth of traffic the engines see:

        load[i] = R × in_flight[i]      (reported[i] + in_flight[i] after a snapshot with nothing in flight here)

    benchmarks/fleet_sim.py measured the alternatives: reported[i] + R × (in flight since the snapshot) herds every
    process onto the engine that looked idle seconds ago (busiest/mean 2.2-2.6 at 100 engines).
    """

    def __init__(self, reported: Sequence[int], in_flight: Sequence[int]) -> None:
        self.reported = list(reported)
        self.at_snapshot = list(in_flight)
        self.in_flight = list(in_flight)
        sent = sum(in_flight)
        self.live = sent > 0  # else no ratio is known yet: the heartbeats plus what this process sends
        self.ratio = max(1.0, sum(reported) / sent) if sent else 1.0
        self.values = [self._estimate(i) for i in range(len(self.reported))]
        self.step = self.ratio if self.live else 1.0  # the load one more request from this process adds, in these units

    def _estimate(self, i: int) -> float:
        return self.ratio * self.in_flight[i] if self.live else self.reported[i] + self.in_flight[i]

    def started(self, i: int) -> None:
        in_flight = self.in_flight[i] = self.in_flight[i] + 1
        self.values[i] = self.ratio * in_flight if self.live else self.reported[i] + in_flight  # `_estimate(i)`

    def ended(self, i: int) -> None:
        in_flight = self.in_flight[i] = self.in_flight[i] - 1
        self.values[i] = self.ratio * in_flight if self.live else self.reported[i] + in_flight  # `_estimate(i)`


def choose(fleet: Fleet, *, adapter: str | None, fingerprints: Sequence[str], loads: Sequence[float],
           step: float = 1.0, exclude: Iterable[int] = ()) -> int | None:
    """The index of the engine to serve a request for `adapter` (a digest, or None for the base model) whose prompt
    has these `fingerprints`, given each engine's current `loads` and the load this request adds (`step`, in the
    same units: `Loads.step`); None if every engine is excluded. An engine keeps its affinity and prefix terms if it
    is still within the bound after taking the request (bounded-load hashing)."""
    if fleet.alone and loads[0] < _UNBOUNDED:  # one engine with a finite score: the best unless excluded
        return None if 0 in exclude else 0
    n = len(fleet.names)
    if n == 0:
        return None
    w = fleet.weights
    static, per_request = fleet.static, fleet.load_per_request
    adapter_terms = w.affinity and adapter is not None
    key = fleet.key(adapter) if adapter is not None else fleet.key(fingerprints[0]) if fingerprints else 0
    within = fleet.within(key, free=adapter_terms) if key else static  # the terms under the bound
    mean = (sum(loads) + step) / n
    # within the bound: load + spill_step × step <= the cap; the least loaded engines always are
    cap = max(mean * (1.0 + w.spill_ratio), mean + w.spill_gap)
    bound = max(cap - w.spill_step * step, min(loads)) if w.bounded else float("inf")
    bonus: dict[int, float] = {}  # affinity and prefix terms of the engines that have any
    if w.affinity:
        if adapter is not None:
            held, free = fleet.held, fleet.free
            if w.cost:  # in place of its absent-load and rendezvous terms
                top = w.hash  # the rendezvous term's most
                for i, tier in fleet.adapters.get(adapter, {}).items():
                    bonus[i] = held[i][tier] + top - within[i] + static[i]
            else:  # in place of its free term
                for i, tier in fleet.adapters.get(adapter, {}).items():
                    bonus[i] = held[i][tier] - free[i]
        if w.prefixes and fingerprints:
            index, depth = fleet.prefix_index, {}
            for k, fingerprint in enumerate(fingerprints, 1):
                for i in index.get(fingerprint, ()):
                    depth[i] = k
            per_chunk = w.prefix / len(fingerprints)
            for i, k in depth.items():
                bonus[i] = bonus.get(i, 0.0) + per_chunk * k
    if len(loads) == n and max(loads) <= bound:  # every engine within the bound (most decisions): in C
        scores = [*map(sub, within, map(mul, per_request, loads))]
    else:
        past_bound = fleet.past_bound if adapter_terms else static
        scores = [(inside if load <= bound else outside) - rate * load
                  for inside, outside, rate, load in zip(within, past_bound, per_request, loads, strict=True)]
    for i, extra in bonus.items():
        if loads[i] <= bound:
            scores[i] += extra
    for i in exclude:
        if 0 <= i < n:
            scores[i] = _EXCLUDED
    best = scores.index(max(scores))  # the first of the best: ties to the lower index
    return None if scores[best] == _EXCLUDED else best


def uncached_tokens(fleet: Fleet, index: int, *, fingerprints: Sequence[str], prompt_chars: int,
                    prompt_tokens: int = 0) -> int:
    """An estimate of the prompt tokens engine `index` would have to compute: the characters past the prefix its
    summary says it holds, at CHARS_PER_TOKEN, plus a prompt given as token ids (never cached as far as the summary
    knows: it fingerprints text only)."""
    cached_chars = fleet.matched_chunks(index, fingerprints) * PREFIX_CHUNK_CHARS
    return max(0, prompt_chars - cached_chars) // CHARS_PER_TOKEN + prompt_tokens


class Route(NamedTuple):
    """Where a request goes: `serving` streams it (and decodes it); `prefill`, when not None, computes its prompt's
    KV first. `reason` says why there is or is no prefill hop: "colocated" (every engine serves whole requests),
    "disaggregated", "short" (the uncached part is under the threshold), "no_prefill_engine", "prefill_only" (no
    engine but prefill-only ones is left: one serves it whole). A named tuple: made on every request, five times
    cheaper than a frozen dataclass."""

    serving: int
    prefill: int | None
    reason: str
    uncached_tokens: int = 0


def choose_route(fleet: Fleet, *, adapter: str | None, fingerprints: Sequence[str], loads: Sequence[float],
                 step: float = 1.0, exclude: Iterable[int] = (), prompt_chars: int = 0, prompt_tokens: int = 0,
                 min_uncached_tokens: int, disaggregate: bool = True) -> Route | None:
    """The engine that serves a request and, on a fleet with roles, the one that prefills it first (llm-d's rule:
    only when the part of the prompt not cached on the serving engine is at least `min_uncached_tokens`). Both are
    `choose`'s answers: the serving one among engines that decode (prefill-only ones are a last resort, serving
    whole), the prefill one among the other prefill engines, else the other "both" ones. None if every engine is
    excluded."""
    excluded = set(exclude)
    serving = choose(fleet, adapter=adapter, fingerprints=fingerprints, loads=loads, step=step,
                     exclude=(excluded | fleet.with_role("prefill")) if fleet.split else excluded)  # fmt: skip
    if serving is None:
        serving = choose(fleet, adapter=adapter, fingerprints=fingerprints, loads=loads, step=step, exclude=excluded)
        return None if serving is None else Route(serving, None, "prefill_only")
    if not fleet.split or not disaggregate:
        return Route(serving, None, "colocated")
    uncached = uncached_tokens(fleet, serving, fingerprints=fingerprints, prompt_chars=prompt_chars,
                               prompt_tokens=prompt_tokens)  # fmt: skip
    if uncached < min_uncached_tokens:
        return Route(serving, None, "short", uncached)
    prefill = None
    for roles in (("decode", "both"), ("decode", "prefill")):  # prefill engines first, then "both" ones
        prefill = choose(fleet, adapter=adapter, fingerprints=fingerprints, loads=loads, step=step,
                         exclude=excluded | {serving} | fleet.with_role(*roles))  # fmt: skip
        if prefill is not None:
            break
    return Route(serving, prefill, "disaggregated" if prefill is not None else "no_prefill_engine", uncached)


def _stable_int(text: str) -> int:
    """The same 64-bit number for the same text in every process (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
