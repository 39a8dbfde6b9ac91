"""The end of a request and its start give what the code before their cuts gave (issue 37, item 23): the
settle's units, the per-request metrics kept per label values, request ids sliced from a batch, and
the request body read with its first message in `__call__`. The code before is kept here as the oracle."""

import asyncio
import itertools
import random
import re
import uuid
from decimal import Decimal
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gateway import asgi, metric_counts, metrics, request_ids
from gateway import exchange as exchange_module
from gateway.admission import Limits, spend_to_micros, spend_to_picos
from gateway.caller import Caller, Target
from gateway.engine_client import EngineRef
from gateway.exchange import Exchange
from gateway.openai_response import Usage
from gateway.request_guard import body_limit
from gateway.serving import Serving
from metering.pricing import Rates, request_price

# -- the settle

ODD = ["m", 'a"b', "50%-bot", "%s%d%%", "caf\u00e9 \u2603", "back\\slash", "line\nbreak", "\u2028", "<&>", ""]


def an_exchange(rng: random.Random) -> Exchange:
    exchange = object.__new__(Exchange)  # only what the settle's event reads
    exchange.request_id = rng.choice([uuid.uuid4().hex, 'r"%s\u00e9', "%%"])
    exchange.caller = Caller(
        key_id=rng.choice([rng.randrange(10**6), "k%1", "ke\u00e9"]), tenant_id=rng.randrange(1, 50), tenant_slug="t",
        limits=Limits(1, 1, 1, -1, -1), default_max_tokens=16, weight=1.0,
        rates=Rates(Decimal(1), Decimal(1), Decimal(1)), model_rates={}, allowed_models=(), expires_at=None,
    )  # fmt: skip
    digest = rng.choice([None, "ab" * 32, "d%\u00e9"])
    exchange.target = Target(name=rng.choice(ODD), base_model=rng.choice(ODD), checkpoint_dir="/x", max_context=64,
                             adapter_id=None, adapter_version_id=rng.choice([None, 3, 10**12]), adapter_version=None,
                             digest=digest, adapter_path=None)  # fmt: skip
    exchange.serving = Serving(exchange.caller, exchange.target)
    exchange.engine = EngineRef(name=rng.choice(ODD[:6]), url="http://e", token="", pool="", gpu_price_per_hour="0",
                                resident=frozenset(), load=0)  # fmt: skip
    exchange.prefill = None
    exchange.started = rng.uniform(0, 10**6)
    exchange.first_token_at = rng.choice([None, exchange.started + rng.random(), exchange.started + 0.1 + 0.2])
    reasons = [rng.choice(["stop", "length", None, "tool_calls"]) for _ in range(rng.randrange(1, 4))]
    exchange.builder = SimpleNamespace(
        usage=Usage(prompt_tokens=rng.choice([0, 7, 2**40]), cached_tokens=rng.choice([0, 3]),
                    completion_tokens=rng.choice([0, 1, 10**9])),
        choices=[SimpleNamespace(finish_reason=reason) for reason in reasons],
    )  # fmt: skip
    return exchange


def test_the_settle_holds_admissions_units_of_the_decimal_price(monkeypatch):
    """What `_settle` hands admission for the engine's counts: spend_to_micros and spend_to_picos of the Decimal
    price, as it did (now from the price in integer picos)."""
    settled = []

    def admission_settle(**fields):
        settled.append(fields)
        return asyncio.sleep(0)

    monkeypatch.setattr(exchange_module, "admission_settle", admission_settle)
    monkeypatch.setattr(metrics, "request_series", {})
    rng = random.Random(41)
    for _ in range(300):
        exchange = an_exchange(rng)
        rates = Rates(*(Decimal(rng.randrange(10**12)).scaleb(-6) for _ in range(3)))
        exchange.serving.rates = rates
        exchange.engine = None  # no engine to tell: the served event written whole
        exchange.usage_reported = True
        exchange.labels = ("1", "m", "base")
        usage = exchange.builder.usage
        usage.cached_tokens = rng.randrange(usage.prompt_tokens + 1)
        asyncio.run(exchange._settle())
        price = request_price(rates=rates, prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                              completion_tokens=usage.completion_tokens)  # fmt: skip
        assert (settled[-1]["spend_micros"], settled[-1]["key_spend_picos"]) == (
            spend_to_micros(price), spend_to_picos(price))  # fmt: skip
        assert settled[-1]["tokens"] == usage.prompt_tokens + usage.completion_tokens and not settled[-1]["final"]


# -- the per-request metrics


def measure_before(families: dict, labels: tuple, outcome: str, seconds: float, usage: Usage, reported: bool) -> None:
    """`Exchange._measure` before its children were kept (the latency's clock read given as `seconds`)."""
    families["requests"].labels(*labels, outcome).inc()
    families["latency"].labels(*labels).observe(seconds)
    if reported:
        families["tokens"].labels(*labels, "prompt").inc(usage.prompt_tokens)
        families["tokens"].labels(*labels, "cached").inc(usage.cached_tokens)
        families["tokens"].labels(*labels, "completion").inc(usage.completion_tokens)


def fresh_families() -> tuple[CollectorRegistry, dict]:
    registry = CollectorRegistry()
    return registry, {
        "requests": metric_counts.Counter(metrics.requests.name, "r", metrics.requests.labelnames, registry=registry),
        "latency": metric_counts.Histogram(metrics.latency.name, "l", metrics.latency.labelnames,
                                           buckets=metrics.SECONDS, registry=registry),
        "tokens": metric_counts.Counter(metrics.tokens.name, "t", metrics.tokens.labelnames, registry=registry),
    }  # fmt: skip


def exposition(registry) -> bytes:
    return re.sub(rb"(_created(?:\{[^}]*\})?) \S+", rb"\1 T", generate_latest(registry))


def measure_now(labels: tuple, outcome: str, seconds: float, usage: Usage, reported: bool) -> None:
    metrics.series_of(labels).ended(outcome, seconds, usage.prompt_tokens, usage.cached_tokens,
                                    usage.completion_tokens, counted=reported)  # fmt: skip


def _outcome(measure, *args) -> str | None:
    """None, or the ValueError a negative count makes `inc` raise (after the counts before it)."""
    try:
        measure(*args)
    except ValueError as error:
        return str(error)
    return None


def test_the_kept_children_count_what_the_look_ups_did(monkeypatch):
    ours, ours_families = fresh_families()
    theirs, their_families = fresh_families()
    for name, family in ours_families.items():
        monkeypatch.setattr(metrics, name, family)
    monkeypatch.setattr(metrics, "request_series", {})
    rng = random.Random(11)
    label_sets = [(str(t), m, a) for t, m, a in itertools.product(["1", "2"], ["m", 'q"\n'], ["base", "abc"])]
    for number in range(2000):
        labels = rng.choice(label_sets)
        outcome = rng.choice(["ok", "ok", "broken", "unserved", "abandoned"])
        seconds = rng.choice([0.0, 0.001, 0.0025, rng.random(), 200.0])
        reported = rng.random() < 0.7
        usage = Usage(prompt_tokens=rng.randrange(100), cached_tokens=rng.randrange(5),
                      completion_tokens=rng.choice([0, 5, -1 if number % 97 == 0 else 3]))  # fmt: skip
        errors = [_outcome(measure_before, their_families, labels, outcome, seconds, usage, reported),
                  _outcome(measure_now, labels, outcome, seconds, usage, reported)]  # fmt: skip
        assert errors[0] == errors[1]
        if number % 100 == 0:
            assert exposition(ours) == exposition(theirs)
    assert exposition(ours) == exposition(theirs) and b'outcome="broken"' in exposition(ours)


# -- request ids


def test_a_batch_of_ids_is_each_16_bytes_as_one_id(monkeypatch):
    stream = random.Random(3)
    reads = []

    def urandom(size: int) -> bytes:
        reads.append(stream.randbytes(size))
        return reads[-1]

    monkeypatch.setattr(request_ids.os, "urandom", urandom)
    request_ids._random_bytes.__dict__.clear()
    ids = [request_ids.request_id_hex() for _ in range(600)]
    random16 = [read[start : start + 16] for read in reads for start in range(0, len(read), 16)]
    assert len(reads) == 3 and ids == [request_ids.request_id_hex(bytes16) for bytes16 in random16[:600]]
    assert all(uuid.UUID(hex=value).variant == uuid.RFC_4122 for value in ids)


# -- the request body


class _TooLarge(Exception):
    pass


async def read_body_before(receive, limit: int) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            raise _TooLarge
        if not message.get("more_body", False):
            return b"".join(chunks)


def _messages(parts: list, *, leaves: bool) -> list[dict]:
    messages = [{"type": "http.request", "body": part, "more_body": True} for part in parts]
    if leaves:
        return [*messages, {"type": "http.disconnect"}]
    if messages:
        messages[-1]["more_body"] = False
    return messages or [{"type": "http.request"}]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/models"])
def test_the_body_is_read_as_before(monkeypatch, route):
    limit = body_limit(method="POST", path=route)
    served = []

    async def serving(*args, **kwargs):
        served.append(args[1] if args else kwargs["raw"])

    async def serve(request, send):
        served.append(request.body)

    monkeypatch.setattr(asgi, "_generate", serving)
    monkeypatch.setattr(asgi, "_serve", serve)
    scope = {"type": "http", "method": "POST", "path": route, "root_path": "", "headers": [], "scheme": "http",
             "query_string": b"", "server": ("127.0.0.1", 8000)}  # fmt: skip
    cases = [([b'{"a": 1}'], False), ([], False), ([b'{"a"', b"", b": 1}"], False), ([b"{"], True), ([], True),
             ([b"x" * (limit + 1)], False), ([b"x" * limit, b"y"], False), ([b"x" * limit], False),
             ([b"x" * (limit - 1), b"y", b"z"], False)]  # fmt: skip
    for parts, leaves in cases:
        try:
            expected = asyncio.run(read_body_before(_receiver(parts, leaves), limit))
        except _TooLarge:
            expected = 413
        served[:] = []
        sent = asyncio.run(_application(scope, _receiver(parts, leaves)))
        if expected == 413:
            assert served == [] and sent[0]["status"] == 413, parts
        else:
            assert served == ([] if expected is None else [expected]) and sent == [], (parts, leaves)


def _receiver(parts: list, leaves: bool):
    messages = iter(_messages(parts, leaves=leaves))

    async def receive():
        return next(messages, {"type": "http.disconnect"})

    return receive


async def _application(scope: dict, receive) -> list[dict]:
    sent = []

    async def send(message):
        sent.append(message)

    await asgi.application(scope, receive, send)
    return sent
