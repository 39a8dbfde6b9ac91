"""A response read from the engine and relayed in one loop (`relay.SseBody`, `asgi._send_stream`, `relay._whole`)
gives what the four async-generator layers before it gave (issue 37, item 23): the same ASGI messages in the same order
around the settle, the same exceptions, the same response and exchange state, for scripted engine answers of every
shape: events split anywhere across arrivals, blank lines, lines json refuses or that are not objects, an unterminated
last line, log-probabilities and tool calls, failed and unknown events, events after the final one, an answer that
ends early or breaks (closed, reset, timed out, not HTTP), a client that leaves or whose writes fail, with and
without the server's head-with-first-chunk extension; streamed by the fast path, as Django's streaming response, and
whole. The code before is kept in `stream_oracle.py`, as it was."""

import asyncio
import json
import random
from types import SimpleNamespace

import pytest

from gateway import asgi, openai_response, relay
from gateway import exchange as exchange_module
from gateway.engine_client import AdapterUnavailable, EngineRef, EngineUnavailable, GenerateStream
from gateway.engine_http import Response, _Pool
from gateway.errors import ApiError
from gateway.exchange import Exchange
from gateway.http_protocol import EXTENSION
from gateway.openai_response import ResponseBuilder
from gateway.token_text import Vocabulary
from tests.gateway import stream_oracle as before

ENGINE = EngineRef(name="e", url="http://e", token="t", pool="", gpu_price_per_hour="0", resident=frozenset(), load=0)
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
TEXTS = ["", " w", 'q"\\\n', "caf\u00e9 \U0001f600"]
TOP = [{"token_id": 7, "logprob": -0.5, "top": {"7": -0.5, "8": -1.5}}]


def a_delta(rng: random.Random, n: int) -> dict:
    event = {"type": "delta", "index": rng.randrange(n), "text": rng.choice(TEXTS), "token_ids": [7] * rng.randint(0, 2)}
    for name in rng.sample(["logprobs", "prompt_logprobs", "tool_calls", "extra", "no_index", "no_ids"], rng.randint(0, 2)):
        if name == "tool_calls":
            event["tool_calls"] = rng.choice([[{"index": 0, "id": "c1", "name": "f", "arguments": ""}],
                                              [{"index": 0, "arguments": '{"x"'}], []])  # fmt: skip
        elif name in ("logprobs", "prompt_logprobs"):
            event[name] = rng.choice([TOP, [], None])
        elif name == "extra":
            event["extra"] = 1
        else:
            event.pop({"no_index": "index", "no_ids": "token_ids"}[name])
    return event


def a_final(rng: random.Random, n: int) -> dict:
    failed = rng.random() < 0.2
    usage = {"prompt_tokens": 3, "cached_tokens": rng.choice([0, 2, None]), "completion_tokens": rng.randint(0, 5)}
    if rng.random() < 0.3:
        usage["kv_transfer"] = rng.choice([{"blocks_pulled": 2}, {"recomputed": True}, "x"])
    return {"type": "final", "finish_reason": "error" if failed else rng.choice(["stop", "length"]),
            "error": rng.choice([None, "out of memory"]) if failed else None,
            "error_type": rng.choice([None, "adapter_unavailable", ""]) if failed else None,
            "choices": [{"index": i, "finish_reason": rng.choice([None, "stop", "length", "tool_calls", "odd"])}
                        for i in range(n)], "usage": usage}  # fmt: skip


def a_line(rng: random.Random, event: dict | None) -> bytes:
    if event is None:  # not an event
        return rng.choice([b"", b" ", b"\r", b"nope", b"{", b"\xff", b"[1]", b"{} x"])
    line = json.dumps(event, separators=(",", ":") if rng.random() < 0.7 else None).encode()
    return rng.choice([line] * 8 + [b" " + line, line + b"\r", b"\t" + line + b" "])


def a_script(rng: random.Random, n: int) -> list:
    """The engine's answer: the head with the first data, then arrivals (bytes) or a failure, as steps."""
    events = [a_delta(rng, n) for _ in range(rng.randint(0, 4))]
    if rng.random() < 0.9:
        events.insert(rng.randint(max(0, len(events) - 1), len(events)), a_final(rng, n))
    if rng.random() < 0.1:
        events.insert(rng.randint(0, len(events)), {"type": "heartbeat"})
    lines = [a_line(rng, event) for event in events]
    for _ in range(rng.choice([0, 0, 0, 1, 2])):
        lines.insert(rng.randint(0, len(lines)), a_line(rng, None))
    body = b"".join(line + b"\n" for line in lines)
    if body and rng.random() < 0.15:
        body = body[:-1]  # the last line unterminated
    cuts = sorted(rng.sample(range(1, len(body)), min(len(body) - 1, rng.randint(0, 4)))) if len(body) > 1 else []
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True) if body[a:b]]
    data = [b"%x\r\n%b\r\n" % (len(piece), piece) for piece in pieces]
    end = rng.choice(["end"] * 6 + ["lost", "reset", "timeout", "garbage"])
    if end == "end":
        data.append(b"0\r\n\r\n")
    steps = []
    for piece in data:  # some pieces come together
        if steps and isinstance(steps[-1], bytes) and rng.random() < 0.4:
            steps[-1] += piece
        else:
            steps.append(piece)
    steps = [HEAD + (steps.pop(0) if steps and rng.random() < 0.7 else b""), *steps]
    if end != "end":
        steps.insert(rng.randint(1, len(steps)), end)
    return steps


class Transport:
    def pause_reading(self): ...
    def resume_reading(self): ...
    def close(self): ...
    def is_closing(self):
        return False


class Engine:
    """Feeds a Response its steps: the first at once, each next one when the reader waits (`arrival`) or a write to
    the client is made while `feed_on_send` says so; `cancel_at` cancels the request at that wait instead."""

    def __init__(self, steps: list, *, cancel_at: int | None):
        self.steps, self.cancel_at, self.waits = list(steps), cancel_at, 0
        self.task: asyncio.Task | None = None
        connection = SimpleNamespace(transport=Transport(), response=None, close=lambda: None, closed=False)
        self.response = Response(_Pool(), ("e", 1), connection, asyncio.get_running_loop(), 60.0)
        self.feed()

    def feed(self) -> None:
        if not self.steps or self.response._connection is None:
            return
        step = self.steps.pop(0)
        if isinstance(step, bytes):
            self.response._received(step)
        elif step == "timeout":
            self.response._time_out()
        elif step == "garbage":
            self.response._received(b"zz\r\n")
        else:
            self.response._lost(None if step == "lost" else ConnectionResetError("reset"))

    def waited(self) -> None:
        self.waits += 1
        if self.waits == self.cancel_at:
            self.task.cancel()
        else:
            self.feed()


def an_exchange(rng: random.Random, fields: dict, log: list, engine: Engine, prefill: bool) -> Exchange:
    exchange = object.__new__(Exchange)
    include_usage = fields.pop("include_usage")
    with pytest.MonkeyPatch.context() as monkey:  # one `created` for the old code's run and the new's
        monkey.setattr(openai_response, "time", SimpleNamespace(time=lambda: 1.0))
        builder = ResponseBuilder(**fields)
    exchange.__dict__.update(
        request_id="r1", caller=SimpleNamespace(tenant_id=1), builder=builder, vocabulary=Vocabulary(None),
        first_token_at=None,
        started=0.0, labels=("t", "m", "base"), target=SimpleNamespace(name="m"), engine=ENGINE, usage_reported=False,
        broke=False, error_type=None, _settled=False, first=[], answer_status=200,
        generation=SimpleNamespace(include_usage=include_usage, stream=True, continuous_usage=False),
        prefill=SimpleNamespace(engine=ENGINE, lease={"id": "l"}, cached_tokens=2) if prefill else None,
    )  # fmt: skip
    exchange.stream = GenerateStream(ENGINE, {})
    exchange.stream.response = engine.response

    async def settle():
        log.append(("settle",))

    exchange._settle = settle
    return exchange


async def run(rng_seed: str, *, new: bool, way: str) -> list:
    """One scenario, old code or new: what was sent and raised, around the settle, and the state after."""
    rng = random.Random(rng_seed)
    n = rng.randint(1, 2)
    kind = rng.choice(["chat", "completion"])
    echo = [f"p{i} \u00e9" for i in range(n)] if kind == "completion" and rng.random() < 0.3 else []
    fields = dict(kind=kind, request_id="r1", model="m", n=n, logprobs=rng.random() < 0.3, echo=echo,
                  include_usage=rng.random() < 0.5)  # fmt: skip
    steps = a_script(rng, n)
    cancel_at = rng.choice([None] * 6 + [1, 2])
    failing_send = rng.choice([None] * 6 + [1, 2, 3])
    failure = rng.choice([OSError("gone"), asyncio.CancelledError()])
    feed_on_send = {rng.randint(1, 4) for _ in range(rng.randint(0, 2))}
    with_cycle = rng.random() < 0.5
    prefill = rng.random() < 0.2
    log: list = []
    engine = Engine(steps, cancel_at=cancel_at)
    exchange = an_exchange(rng, fields, log, engine, prefill)
    monkey = pytest.MonkeyPatch()
    original = Response.arrival

    def arrival(self):
        waiter = original(self)
        asyncio.get_running_loop().call_soon(engine.waited)
        return waiter

    monkey.setattr(Response, "arrival", arrival)
    monkey.setattr(exchange_module, "end_lease", lambda hop, request_id: log.append(("end_lease", request_id)))
    sends = 0

    async def send(message):
        nonlocal sends
        sends += 1
        log.append(("send", message.get("body"), message.get("more_body"), "headers" in message))
        if sends == failing_send:
            raise failure
        if sends in feed_on_send:
            engine.feed()

    async def start_with_body(start, message):
        log.append(("start_with_body", message["body"]))

    # its write_now declines (as under flow control), so every body message goes through `send` as before; its
    # bytes against the server's own send: test_direct_routes.py
    cycle = SimpleNamespace(start_with_body=start_with_body, write_now=lambda data, more: False) if with_cycle else None
    start = {"type": "http.response.start", "status": 200, "headers": []}

    async def scenario():
        opened = await (_opened_new if new else before.opened)(exchange)
        log.append(("opened", opened))
        if opened != "ok":
            return
        if way == "whole":
            try:
                answer = await (relay._whole if new else before.whole)(exchange)
                log.append(("answer", answer.status_code, answer.content))
            except ApiError as error:
                log.append(("refused", error.status, error.code, error.message))
        elif way == "django":  # a StreamingHttpResponse of the body, sent by asgi._send
            if new:
                await asgi._send_chunks(relay._sse(relay.SseBody(exchange)), send)
            else:
                await before.send_stream(before.sse(exchange), send)
        elif new:
            await asgi_stream_part(exchange, send, cycle, start)
        else:
            await before.stream_part(exchange, before.sse(exchange), send, cycle, start)

    try:
        task = engine.task = asyncio.ensure_future(scenario())
        try:
            await task
        except BaseException as error:  # noqa: BLE001 - what the code raised is compared
            log.append(("raised", type(error).__name__, str(error)))
        builder = exchange.builder
        log.append(("state", builder.choices, builder.usage, sorted(builder._role_sent), exchange.usage_reported,
                    exchange.broke, exchange.error_type, exchange.first_token_at is None, exchange.answer_status,
                    exchange.stream.finished if exchange.stream else None))  # fmt: skip
    finally:
        monkey.undo()
        engine.response.close()
    return log


async def _opened_new(exchange: Exchange) -> str:
    """Exchange._try's reading of the first events (the engine stream is open)."""
    original = GenerateStream.open

    async def opened(stream):
        stream.response = exchange.stream.response
        return stream

    GenerateStream.open = opened
    exchange.payload = lambda engine: {}
    try:
        await exchange._try(ENGINE)
    except (EngineUnavailable, AdapterUnavailable) as error:
        return type(error).__name__
    finally:
        GenerateStream.open = original
    return "ok"


async def asgi_stream_part(exchange: Exchange, send, cycle, start) -> None:
    """asgi._generate, its stream part: the request admitted (`exchange`) and its stream open."""

    async def admitted(**_):
        return exchange, {}

    async def open_stream(exchange, headers):
        return relay.SseBody(exchange)

    scope = {"method": "POST", "path": "/v1/completions", "headers": [], "extensions": {EXTENSION: cycle} if cycle else {}}
    with pytest.MonkeyPatch.context() as monkey:
        monkey.setattr(asgi.views, "generation_admit", admitted)
        monkey.setattr(asgi.relay, "open_stream", open_stream)
        await asgi._generate(scope, b"{}", send, kind="completion", secure=False, received=0.0)


@pytest.mark.parametrize("way", ["stream", "whole", "django"])
@pytest.mark.parametrize("part", range(4))
def test_the_same_messages_errors_and_state_as_before(way, part):
    for number in range(part * 250, (part + 1) * 250):
        seed = f"{number}"
        old = asyncio.run(run(seed, new=False, way=way))
        new = asyncio.run(run(seed, new=True, way=way))
        assert new == old, seed
