"""The request's path from its parsed body to the engine stream, cheaper (issue 37, item 23), gives what the code before
it gave: the engine payload and its metadata (key order too), the metrics' labels, the prompt's token count, the
engine choice. The code before is kept below as the oracle."""

import asyncio
import json
import math
import random
from collections.abc import Iterable, Sequence
from decimal import Decimal

import pytest
from asgiref.sync import iscoroutinefunction

from gateway import exchange as exchange_module
from gateway import prompt_tokens as prompt_tokens_module
from gateway.admission import Limits, admission_acquire, admission_admit
from gateway.caller import Caller, Target
from gateway.disaggregation import PrefillHop, decode_payload
from gateway.engine_client import EngineRef
from gateway.exchange import Exchange
from gateway.metrics import adapter_label
from gateway.openai_request import parse_chat, parse_completion
from gateway.prompt_tokens import count_prompt_tokens, estimate_prompt_tokens, prompt_tokens
from gateway.route_score import Candidate, Fleet, Loads, Weights, choose
from gateway.serving import serving
from metering.pricing import Rates

# -- the engine payload, its metadata and the labels (Exchange.payload and .metadata before, as methods' bodies)


def metadata_before(caller: Caller, target: Target, engine: EngineRef, prefill) -> dict:
    metadata = {
        "tenant_id": caller.tenant_id, "api_key_id": caller.key_id, "model": target.name,
        "base_model": target.base_model, "adapter_version_id": target.adapter_version_id, "engine": engine.name,
    }  # fmt: skip
    if prefill is not None and engine.name != prefill.engine.name:
        metadata["prefill"] = prefill.attribution()
    return metadata


def payload_before(request_id, caller, target, generation, max_tokens, engine, prefill, metadata_accepted) -> dict:
    payload = {
        "request_id": request_id,
        "tenant": str(caller.tenant_id),
        "weight": caller.weight,
        "api_key_id": str(caller.key_id),
        "adapter": {"digest": target.digest, "path": target.adapter_path} if target.digest else None,
        "sampling": generation.sampling | {"max_tokens": max_tokens},
        "stream": True,
    }
    if generation.max_tokens_given:
        payload["context_overflow"] = "refuse"
    if metadata_accepted:
        payload["metadata"] = metadata_before(caller, target, engine, prefill)
    if generation.messages is not None:
        payload["messages"] = generation.messages
        payload |= generation.structure
    else:
        prompts = generation.prompts
        name = "prompt" if isinstance(prompts[0], str) else "prompt_token_ids"
        payload[name] = prompts[0] if len(prompts) == 1 else prompts
    if prefill is not None and engine.name != prefill.engine.name:
        payload = decode_payload(payload, prefill)
    return payload


def a_caller(key_id, tenant_id: int, weight: float) -> Caller:
    rates = Rates(Decimal(1), Decimal(2), Decimal(3))
    return Caller(key_id=key_id, tenant_id=tenant_id, tenant_slug="t", limits=Limits(1, 1, 1, -1, -1),
                  default_max_tokens=16, weight=weight, rates=rates, model_rates={}, allowed_models=(),
                  expires_at=None)  # fmt: skip


def a_target(name: str, digest: str | None, version_id: int | None) -> Target:
    return Target(name=name, base_model="base", checkpoint_dir="/nowhere", max_context=256, adapter_id=1 if digest else None,
                  adapter_version_id=version_id, adapter_version=3 if digest else None, digest=digest,
                  adapter_path=f"/store/{digest}" if digest else None)  # fmt: skip


def an_engine(name: str) -> EngineRef:
    return EngineRef(name=name, url="http://e", token="", pool="", gpu_price_per_hour="1", resident=frozenset(), load=0)


BODIES = [
    {"model": "m", "prompt": "p"}, {"model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 5},
    {"model": "m", "prompt": [1, 2, 3], "temperature": 0.5, "stop": ["x"]}, {"model": "m", "prompt": [[1], [2, 3]]},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9, "seed": 3},
    {"model": "m", "messages": [{"role": "user", "content": "q"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "tool_choice": "auto"},
]  # fmt: skip


def test_the_payload_metadata_and_labels_as_before(monkeypatch):
    rng = random.Random(37)
    callers = [a_caller(1, 10, 1.0), a_caller("k2", 11, 2.5), a_caller(1, 10, 3.0)]  # the third: key 1 changed
    targets = [a_target("m", None, None), a_target("m", "d" * 64, 7), a_target("m@3", "e" * 64, 8)]
    engines = [an_engine("a"), an_engine("b")]
    for _ in range(300):
        caller, target, body = rng.choice(callers), rng.choice(targets), rng.choice(BODIES)
        generation = parse_chat(dict(body)) if "messages" in body else parse_completion(dict(body))
        engine = rng.choice(engines)
        accepted = rng.random() < 0.8
        monkeypatch.setattr(exchange_module, "_metadata_accepted", {} if accepted else {engine.name: False})
        shared = serving(caller, target)
        assert shared is serving(caller, target)  # kept for the same objects
        made = Exchange(request_id="r1", serving=shared, generation=generation, max_tokens=12,
                        choices=generation.num_choices, prompt_bytes=generation.prompt_bytes(), hold_tokens=1,
                        hold_spend=Decimal(0), received=0.0)  # fmt: skip
        prefill = None
        if rng.random() < 0.3:
            prefill = PrefillHop(engine=rng.choice(engines), lease={"id": "l"}, gpu_ms=1.5, prompt_tokens=3, cached_tokens=1)
            made.prefill = prefill
        for _ in range(2):  # the second time from what the first one kept
            got = made.payload(engine)
            expected = payload_before("r1", caller, target, generation, 12, engine, prefill, accepted)
            assert json.dumps(got) == json.dumps(expected)  # the same keys in the same order, the same values
            assert made.metadata(engine) == metadata_before(caller, target, engine, prefill)
        assert made.labels == (str(caller.tenant_id), target.name, adapter_label(target.digest))
        assert (made.caller, made.target) == (caller, target)


# -- the prompt's tokens


class Counting:
    """A tokenizer that counts one token per word."""

    def count(self, text: str, *, add_special_tokens: bool = True) -> int:
        return len(text.split())


@pytest.mark.parametrize("prompt", ["one two three", "", ["a b", "c d e"], ["solo"], [1, 2, 3], [[1, 2], [3]]])
@pytest.mark.parametrize("tokenizer", [Counting(), None], ids=["tokenizer", "none"])
def test_the_prompts_tokens_as_before(monkeypatch, prompt, tokenizer):
    monkeypatch.setattr(prompt_tokens_module, "base_tokenizer", lambda checkpoint_dir: tokenizer)
    generation = parse_completion({"model": "m", "prompt": prompt})
    target = a_target("m", None, None)
    before = estimate_prompt_tokens(generation) if tokenizer is None else prompt_tokens(generation, tokenizer)
    assert asyncio.run(count_prompt_tokens(generation, target)) == before
    assert asyncio.run(count_prompt_tokens(generation, target, prompt_bytes=generation.prompt_bytes())) == before


def test_admission_acquire_is_awaited_as_a_coroutine_function():
    for function in (admission_acquire, admission_admit):
        assert iscoroutinefunction(function) and asyncio.iscoroutinefunction(function)


# -- the engine choice (route_score.choose before, its docstring left out)


def choose_before(fleet: Fleet, *, adapter: str | None, fingerprints: Sequence[str], loads: Sequence[float],
                  step: float = 1.0, exclude: Iterable[int] = ()) -> int | None:
    n = len(fleet.names)
    if n == 0:
        return None
    w = fleet.weights
    mean = (sum(loads) + step) / n
    cap = max(mean * (1.0 + w.spill_ratio), mean + w.spill_gap)
    bound = max(cap - w.spill_step * step, min(loads)) if w.bounded else float("inf")
    bonus: dict[int, float] = {}
    key = fleet.key(adapter) if adapter is not None else fleet.key(fingerprints[0]) if fingerprints else 0
    if w.affinity:
        if adapter is not None:
            for i, is_resident in fleet.adapters.get(adapter, {}).items():
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
    within = fleet.within(key, free=w.affinity and adapter is not None) if key else static
    scores = [(inside if load <= bound else outside) - rate * load
              for inside, outside, rate, load in zip(within, static, per_request, loads, strict=True)]
    for i, extra in bonus.items():
        if loads[i] <= bound:
            scores[i] += extra
    for i in exclude:
        if 0 <= i < n:
            scores[i] = -math.inf
    best = scores.index(max(scores))
    return None if scores[best] == -math.inf else best


def a_fleet(rng: random.Random, size: int) -> Fleet:
    kv = [0.0, 0.3, 1.0] + ([math.inf, math.nan] if size == 1 else [])  # one engine: not finite reads as before
    weights = rng.choice([Weights(), Weights(affinity=False), Weights(bounded=False), Weights(kv=math.inf)])
    return Fleet([Candidate(f"e{i}", capacity=rng.choice([1, 8]), load=rng.randint(0, 9), kv_usage=rng.choice(kv),
                            resident=frozenset({"hot"}) if rng.random() < 0.4 else frozenset(),
                            prefixes=frozenset({"f1"}) if rng.random() < 0.3 else frozenset())
                  for i in range(size)], weights=weights)  # fmt: skip


def test_the_engine_chosen_as_before_one_engine_or_many():
    rng = random.Random(41)
    for _ in range(3000):
        fleet = a_fleet(rng, rng.choice([1, 1, 2, 3, 6]))
        loads = Loads(fleet.base_loads(), [rng.randint(0, 3) for _ in fleet.names])
        values = list(loads.values)
        if rng.random() < 0.2:  # one engine far past the others: outside the bound
            values[rng.randrange(len(values))] += 50
        exclude = rng.choice([(), [0], [1, 7], {-1}, [0, 1, 2, 3, 4, 5]])
        kwargs = dict(adapter=rng.choice([None, "hot", "cold"]), fingerprints=rng.choice([[], ["f1", "f2"]]),
                      loads=values, step=loads.step, exclude=exclude)  # fmt: skip
        assert choose(fleet, **kwargs) == choose_before(fleet, **kwargs), (fleet.candidates, kwargs)
