"""The request path's cheaper steps give what the code before them gave (issue 37, item 23): the cached caller and
model, the rate-limit headers (their order too), the engine choice with engines excluded or suspect, the prompt's
token count, the served usage's JSON and the model name's check. Each step's code before is kept here, as it was,
as the oracle."""

import asyncio
import hashlib
import itertools
import random
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from gateway import caller as caller_module
from gateway import generation, request_reports, routing
from gateway.admission import UNLIMITED, Decision, Limits
from gateway.caller import Caller, Target, cached_caller_and_target
from gateway.engine_client import EngineRef
from gateway.errors import ApiError
from gateway.openai_request import parse_completion
from gateway.prompt_tokens import prompt_tokens
from gateway.refusals import KEY_WINDOW_REASONS, ratelimit_headers
from gateway.request_guard import _SURROGATE, MAX_MODEL_NAME, model_name_check
from gateway.route_score import Candidate, Fleet, Loads, Route, uncached_tokens
from metering.pricing import Rates

# -- the cached caller and model


def cached_before(*, authorization: str, model, callers: dict, targets: dict, now: float, lifetime: float, today):
    def fresh(entry):
        return entry is not None and now - entry[0] < lifetime

    entry = callers.get(hashlib.sha256(authorization.encode()).digest())
    if not fresh(entry):
        return None
    found = entry[1]
    if found.expires_at is not None and found.expires_at <= today:
        return None
    if not isinstance(model, str) or not model:
        return found, None
    target = targets.get((found.tenant_id, model))
    if not found.may_use(model) or not fresh(target):
        return None
    return found, target[1]


def a_caller(tenant_id: int, allowed: tuple[str, ...], expires_at) -> Caller:
    rates = Rates(Decimal(1), Decimal(1), Decimal(1))
    return Caller(key_id=tenant_id, tenant_id=tenant_id, tenant_slug="t", limits=Limits(1, 1, 1, -1, -1),
                  default_max_tokens=16, weight=1.0, rates=rates, model_rates={}, allowed_models=allowed,
                  expires_at=expires_at)  # fmt: skip


def a_target(name: str) -> Target:
    return Target(name=name, base_model="b", checkpoint_dir="/x", max_context=64, adapter_id=None,
                  adapter_version_id=None, adapter_version=None, digest=None, adapter_path=None)  # fmt: skip


def test_the_cached_caller_and_model_as_before(monkeypatch, settings):
    settings.QUILT_KEY_CACHE_SECONDS = 30
    today = datetime.now(UTC)
    rng = random.Random(37)
    keys = ["Bearer a", "Bearer b", "Bearer c", ""]
    models = [None, "", 3, "m1", "m1@2", "m2", "m3"]
    for _ in range(400):
        now = 1000.0
        callers, targets = {}, {}
        for key in keys[:3]:
            if rng.random() < 0.8:
                expires = rng.choice([None, today - timedelta(days=1), today + timedelta(days=1)])
                allowed = rng.choice([(), ("m1",), ("m2", "m3")])
                found = a_caller(keys.index(key) + 1, allowed, expires)
                callers[hashlib.sha256(key.encode()).digest()] = (now - rng.choice([0, 10, 29.9, 30, 45]), found)
                for name in ("m1", "m1@2", "m2", "m3"):
                    if rng.random() < 0.7:
                        targets[(found.tenant_id, name)] = (now - rng.choice([0, 29.9, 30, 60]), a_target(name))
        monkeypatch.setattr(caller_module, "_callers", callers)
        monkeypatch.setattr(caller_module, "_targets", targets)
        monkeypatch.setattr(caller_module.time, "monotonic", lambda now=now: now)
        for key, model in itertools.product(keys, models):
            before = cached_before(authorization=key, model=model, callers=callers, targets=targets, now=now,
                                   lifetime=30, today=today)  # fmt: skip
            assert cached_caller_and_target(authorization=key, model=model) == before, (key, model)


# -- the rate-limit headers


def headers_before(found: Caller, decision: Decision) -> dict[str, str]:
    limits = found.limits
    reset = f"{decision.reset_ms / 1000:.3f}s"
    requests, tokens = limits.requests_per_minute, limits.tokens_per_minute
    if decision.reason in KEY_WINDOW_REASONS:
        requests, tokens = limits.key_requests_per_minute, limits.key_tokens_per_minute
    headers = {}
    if requests != UNLIMITED:
        headers["x-ratelimit-limit-requests"] = str(requests)
        headers["x-ratelimit-remaining-requests"] = str(max(0, requests - decision.window_requests))
        headers["x-ratelimit-reset-requests"] = reset
    if tokens != UNLIMITED:
        headers["x-ratelimit-limit-tokens"] = str(tokens)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, tokens - decision.window_tokens))
        headers["x-ratelimit-reset-tokens"] = reset
    return headers


@pytest.mark.parametrize("reason", ["ok", "requests", "tokens", "key_requests", "key_tokens"])
def test_the_rate_limit_headers_as_before_in_the_same_order(reason):
    for requests, tokens, key_requests, key_tokens in itertools.product([UNLIMITED, 5], [UNLIMITED, 100], repeat=2):
        limits = Limits(requests, tokens, 10, -1, -1, key_prefix="k", key_requests_per_minute=key_requests,
                        key_tokens_per_minute=key_tokens)  # fmt: skip
        found = a_caller(1, (), None)
        object.__setattr__(found, "limits", limits)
        if reason == "ok" and UNLIMITED in (requests, tokens) and (key_requests, key_tokens) != (UNLIMITED, UNLIMITED):
            continue  # changed since: an admitted call reports the key's limit of a kind the plan leaves unlimited
            # (test_ratelimit_headers.py)
        for window_requests, window_tokens, reset_ms in [(0, 0, 0), (7, 150, 59_999), (3, 20, 1234)]:
            decision = Decision(reason == "ok", reason, window_requests, window_tokens, reset_ms)
            got = ratelimit_headers(found, decision)
            assert list(got.items()) == list(headers_before(found, decision).items())


# -- the engine choice with engines excluded or suspect (choose and choose_route before, their docstrings left out)


def route_before(router: routing.Router, *, exclude: frozenset[str], now: float, **kwargs):
    skipped = [i for i, e in enumerate(router._engines)
               if e.name in exclude or router._suspect_until.get(e.name, 0.0) > now]  # fmt: skip
    route = choose_route_before(router._fleet, loads=router._loads.values, step=router._loads.step, exclude=skipped,
                                **kwargs)  # fmt: skip
    return None if route is None else (route.serving, route.prefill, route.reason, route.uncached_tokens)


def choose_before(fleet: Fleet, *, adapter: str | None, fingerprints: Sequence[str], loads: Sequence[float],
           step: float = 1.0, exclude: Iterable[int] = ()) -> int | None:
    n = len(fleet.names)
    if n == 0:
        return None
    w = fleet.weights
    excluded = set(exclude)
    mean = (sum(loads) + step) / n
    # within the bound: load + spill_step × step <= the cap; the least loaded engines always are
    cap = max(mean * (1.0 + w.spill_ratio), mean + w.spill_gap)
    bound = max(cap - w.spill_step * step, min(loads)) if w.bounded else float("inf")
    bonus: dict[int, float] = {}  # affinity and prefix terms of the engines that have any
    key = fleet.key(adapter) if adapter is not None else fleet.key(fingerprints[0]) if fingerprints else 0
    if w.affinity:
        if adapter is not None:
            for i, is_resident in fleet.adapters.get(adapter, {}).items():  # in place of its free term, added below
                bonus[i] = (w.resident if is_resident else w.loading) - fleet.free[i]
        if w.prefixes and fingerprints:
            index, depth = fleet.prefix_index, {}
            for k, fingerprint in enumerate(fingerprints, 1):
                for i in index.get(fingerprint, ()):
                    depth[i] = k
            per_chunk = w.prefix / len(fingerprints)
            for i, k in depth.items():
                bonus[i] = bonus.get(i, 0.0) + per_chunk * k
    static, per_request = fleet.static, fleet.load_per_request
    within = fleet.within(key, free=w.affinity and adapter is not None) if key else static  # terms under the bound
    scores = [(inside if load <= bound else outside) - rate * load
              for inside, outside, rate, load in zip(within, static, per_request, loads, strict=True)]
    for i, extra in bonus.items():
        if loads[i] <= bound:
            scores[i] += extra
    for i in excluded:
        if 0 <= i < n:
            scores[i] = float("-inf")
    best = max(range(n), key=scores.__getitem__)
    return None if scores[best] == float("-inf") else best


def choose_route_before(fleet: Fleet, *, adapter: str | None, fingerprints: Sequence[str], loads: Sequence[float],
                 step: float = 1.0, exclude: Iterable[int] = (), prompt_chars: int = 0, prompt_tokens: int = 0,
                 min_uncached_tokens: int, disaggregate: bool = True) -> Route | None:
    excluded = set(exclude)
    serving = choose_before(fleet, adapter=adapter, fingerprints=fingerprints, loads=loads, step=step,
                     exclude=excluded | fleet.with_role("prefill"))  # fmt: skip
    if serving is None:
        serving = choose_before(fleet, adapter=adapter, fingerprints=fingerprints, loads=loads, step=step, exclude=excluded)
        return None if serving is None else Route(serving, None, "prefill_only")
    if not fleet.split or not disaggregate:
        return Route(serving, None, "colocated")
    uncached = uncached_tokens(fleet, serving, fingerprints=fingerprints, prompt_chars=prompt_chars,
                               prompt_tokens=prompt_tokens)  # fmt: skip
    if uncached < min_uncached_tokens:
        return Route(serving, None, "short", uncached)
    prefill = None
    for roles in (("decode", "both"), ("decode", "prefill")):  # prefill engines first, then "both" ones
        prefill = choose_before(fleet, adapter=adapter, fingerprints=fingerprints, loads=loads, step=step,
                         exclude=excluded | {serving} | fleet.with_role(*roles))  # fmt: skip
        if prefill is not None:
            break
    return Route(serving, prefill, "disaggregated" if prefill is not None else "no_prefill_engine", uncached)


def a_router(rng: random.Random, roles: list[str]) -> routing.Router:
    router = routing.Router()
    names = [f"e{i}" for i in range(len(roles))]
    router._engines = [EngineRef(name=name, url="http://x", token="", pool="", gpu_price_per_hour="0", resident=set(),
                                 load={}) for name in names]  # fmt: skip
    router._fleet = Fleet([Candidate(name, capacity=8, load=rng.randint(0, 5), role=role,
                                     resident=frozenset({"hot"}) if rng.random() < 0.3 else frozenset())
                           for name, role in zip(names, roles, strict=True)])  # fmt: skip
    router._index = {name: i for i, name in enumerate(names)}
    router._loads = Loads(router._fleet.base_loads(), [0] * len(names))
    return router


def test_the_route_as_before_with_engines_excluded_or_suspect(monkeypatch):
    rng = random.Random(23)
    now = 500.0
    monkeypatch.setattr(routing.time, "monotonic", lambda: now)
    for _ in range(600):
        roles = [rng.choice(["both", "both", "prefill", "decode"]) for _ in range(rng.randint(1, 5))]
        router = a_router(rng, roles)
        names = [engine.name for engine in router._engines]
        router._suspect_until = {name: now + rng.choice([-1.0, 0.0, 2.0]) for name in names if rng.random() < 0.3}
        suspects = dict(router._suspect_until)
        exclude = frozenset(name for name in names if rng.random() < 0.2)
        args = dict(digest=rng.choice([None, "hot"]), fingerprints=rng.choice([[], ["f1", "f2"]]), prompt_chars=800,
                    prompt_tokens=0, min_uncached_tokens=rng.choice([0, 10_000]), disaggregate=rng.random() < 0.8)  # fmt: skip
        expected = route_before(router, exclude=exclude, now=now, adapter=args["digest"],
                                fingerprints=args["fingerprints"], prompt_chars=800, prompt_tokens=0,
                                min_uncached_tokens=args["min_uncached_tokens"], disaggregate=args["disaggregate"])  # fmt: skip
        route = router.route(exclude=exclude, **args)
        got = None if route is None else (names.index(route.engine.name),
                                          None if route.prefill is None else names.index(route.prefill.name),
                                          route.reason, route.uncached_tokens)  # fmt: skip
        assert got == expected, (roles, suspects, exclude, args)
        assert {name for name, until in router._suspect_until.items() if until > now} == \
            {name for name, until in suspects.items() if until > now}  # fmt: skip


# -- the prompt's tokens, the served usage's JSON, the model name, the request log's time


class Counting:
    """A tokenizer that counts one token per word."""

    def count(self, text: str, *, add_special_tokens: bool = True) -> int:
        return len(text.split())


@pytest.mark.parametrize("prompt", ["one two three", ["a b", "c d e", ""], [1, 2, 3], [[1, 2], [3], [4, 5, 6]]])
def test_a_completions_prompt_tokens_as_before(prompt):
    generation = parse_completion({"model": "m", "prompt": prompt})
    tokenizer = Counting()
    texts = [p for p in generation.prompts if isinstance(p, str)]
    before = sum(len(text.split()) for text in texts) + generation.prompt_token_count()
    assert prompt_tokens(generation, tokenizer) == before


NAMES = ["m", "caf\u00e9", "a\x00b", "\ud800", "x\udfff", "\U0001f600", "m" * MAX_MODEL_NAME, "m" * (MAX_MODEL_NAME + 1), 3]


@pytest.mark.parametrize("name", NAMES)
def test_the_model_name_check_as_before(name):
    def before(name):
        if not isinstance(name, str):
            return None
        if len(name) > MAX_MODEL_NAME:
            return "long"
        return "odd" if "\x00" in name or _SURROGATE.search(name) else None

    try:
        model_name_check(name)
        got = None
    except ApiError as error:
        got = "long" if "longer" in error.message else "odd"
    assert got == before(name)


def test_the_request_logs_end_to_end_time(monkeypatch):
    reports = []
    monkeypatch.setattr(request_reports, "_put", reports.append)
    monkeypatch.setattr(request_reports.time, "monotonic", lambda: 12.3456789)
    request_reports.answered(request_id="r", status_code=200, received=10.0, first_token=11.0)
    assert reports == [{"kind": "answered", "request_id": "r", "status_code": 200, "ttft_ms": 1000.0,
                        "e2e_ms": round((12.3456789 - 10.0) * 1000.0, 3)}]  # fmt: skip


# -- authentication from the cache without a coroutine


def test_a_cached_caller_is_used_without_the_lookups_coroutine_and_a_miss_still_looks_up(monkeypatch):
    found, target = a_caller(1, (), None), a_target("m")
    cache = {"Bearer hit": (found, target)}
    looked_up, admitted = [], []

    async def authorize(*, authorization, model):
        looked_up.append((authorization, model))
        return found, target

    async def admit(**kwargs):
        admitted.append((kwargs["caller"], kwargs["target"], kwargs["generation"].model))
        return "exchange", {}

    monkeypatch.setattr(generation, "cached_caller_and_target", lambda *, authorization, model: cache.get(authorization))
    monkeypatch.setattr(generation, "authorize", authorize)
    monkeypatch.setattr(generation.relay, "admit", admit)
    raw = b'{"model": "m", "prompt": "p"}'
    for authorization in ("Bearer hit", "Bearer miss"):
        answer = asyncio.run(generation.admit(kind="completion", raw=raw, content_type="application/json",
                                               authorization=authorization, request_id="r", received=0.0))  # fmt: skip
        assert answer == ("exchange", {})
    assert looked_up == [("Bearer miss", "m")]
    assert admitted == [(found, target, "m"), (found, target, "m")]
