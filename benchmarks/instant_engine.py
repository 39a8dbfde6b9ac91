"""An engine stand-in for benchmarks only: speaks the engine's internal API (health, state, tokenize, generate as
NDJSON, abort) and answers every generate at once with one token per `max_tokens` and a final event with usage, so
that what a benchmark measures through the gateway is the gateway's own cost. Not for tests of user paths, which
run the real engine.

    python -m uvicorn benchmarks.instant_engine:app --http httptools --loop uvloop \
        --port 8199 --log-level warning --no-access-log

It runs under the engine's server options (`HTTP`, as `python -m engine` serves), so its writes are framed as the real
engine's are: a streamed answer's head, its first event, then the rest with the response's end (as the real engine
writes a two-token answer whose second token and final event come in one step). Its /v1/state offers the generate
channel (engine.contract.channel), where the same answer is two messages: the first event, then the rest.
"""

import json

import msgspec

from engine.contract.channel import CHANNEL_PATH, ChannelHead, channel_message
from engine.contract.state import Adapters, EngineState, LoadSeconds, Memory, PoolCounts

# uvicorn's options: the engine's (engine/__main__.py)
HTTP = ("--http", "httptools", "--loop", "uvloop", "--ws", "websockets-sansio")

STATE = msgspec.json.encode(EngineState(  # an idle engine with no pages, offering the generate channel
    model="bench", role="both", accepting=True, capacity=128, running=0, waiting=0, kv_blocks_used=0,
    kv_blocks_free=0, kv_blocks_total=0,
    kv_pool=PoolCounts(total=0, free=0, evictable=0, in_use=0, held=0, adapter_pages=0),
    prefix_cache_hit_rate=0.0, busy_ms=0.0, steps=0, preemptions=0, tokens_per_second=0.0,
    memory=Memory(page_bytes=0, pages_total=0, base_weights_bytes=0, kv_pages_bytes=0, adapter_pages_bytes=0,
                  free_bytes=0, quantization="none", kv_cache_dtype="auto", base_weights_full_precision_bytes=0,
                  kv_bytes_per_token=0.0, kv_bytes_per_token_full_precision=0.0, kv_capacity_tokens=0,
                  kv_capacity_tokens_full_precision=0),
    adapters=Adapters(gpu=[], host=[], loading=[], placing=[], in_use=[], pinned={}, residency=[],
                      load_seconds=LoadSeconds(), failed={}, registered=0, host_bytes=0, device_pages=0),
    prefixes=[], channel=CHANNEL_PATH,
))  # fmt: skip
HEALTH = json.dumps({"status": "ok", "model": "bench"}).encode()
JSON = [(b"content-type", b"application/json")]


async def _body(receive) -> bytes:
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b""
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


async def _answer(send, status: int, body: bytes, headers=JSON) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def answer_lines(request: dict) -> list[bytes]:
    """A generate's NDJSON lines: one delta per token of `max_tokens`, then the final event with usage."""
    tokens = int((request.get("sampling") or {}).get("max_tokens") or 1)
    request_id = request.get("request_id") or "r"
    delta = {"type": "delta", "request_id": request_id, "index": 0, "text": " w", "token_ids": [7]}
    final = {
        "type": "final", "request_id": request_id, "finish_reason": "length", "error": None,
        "choices": [{"index": 0, "text": " w" * tokens, "token_ids": [7] * tokens, "finish_reason": "length",
                     "error": None, "error_type": None}],
        "usage": {"prompt_tokens": 3, "cached_tokens": 0, "completion_tokens": tokens},
    }  # fmt: skip
    return [json.dumps(delta).encode() + b"\n"] * tokens + [json.dumps(final).encode() + b"\n"]


async def channel(receive, send) -> None:
    """The generate channel: each generate answered at once, in two messages."""
    await receive()  # websocket.connect
    await send({"type": "websocket.accept"})
    while (message := await receive())["type"] == "websocket.receive":
        request = json.loads(message.get("bytes") or message.get("text"))
        lines, request_id = answer_lines(request), request["request_id"]
        await send({"type": "websocket.send", "bytes": channel_message(ChannelHead(request_id), lines[0])})
        rest = b"".join(lines[1:])
        await send({"type": "websocket.send", "bytes": channel_message(ChannelHead(request_id, last=True), rest)})


async def app(scope, receive, send) -> None:
    if scope["type"] == "websocket" and scope["path"] == CHANNEL_PATH:
        await channel(receive, send)
        return
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path == "/v1/health":
        await _answer(send, 200, HEALTH)
    elif path == "/v1/state":
        await _answer(send, 200, STATE)
    elif path == "/v1/tokenize":
        request = json.loads(await _body(receive) or b"{}")
        text = request.get("prompt") or json.dumps(request.get("messages"))
        await _answer(send, 200, json.dumps({"count": len(str(text).split())}).encode())
    elif path.startswith("/v1/abort/"):
        await _answer(send, 200, b"{}")
    elif path == "/v1/generate":
        lines = answer_lines(json.loads(await _body(receive)))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/x-ndjson")]})
        await send({"type": "http.response.body", "body": lines[0], "more_body": True})
        await send({"type": "http.response.body", "body": b"".join(lines[1:])})
    else:
        await _answer(send, 404, b'{"error": {"type": "not_found", "message": "unknown path"}}')
