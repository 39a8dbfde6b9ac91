"""A floor for the gateway's CPU per request, for benchmarks only: the completion route relayed to an engine with
none of the gateway's own work (no key, no admission, no token count, no usage, no request log, no metrics), only
what any proxy of a streamed completion must do: read the client's request, parse its JSON, send the engine's
request (through aiohttp, as the gateway's `engine_client`), read its NDJSON events, write them as OpenAI SSE
chunks and the end. With QUILT_NULL_REDIS=1 it also makes two Redis round trips per request (the gateway's Redis client,
`gateway.admission.redis_client`, a one-line script with arguments of the size of admission's two), so that the
difference from the gateway is its application's Python, not its round trips.

    QUILT_NULL_ENGINE_URL=http://127.0.0.1:8199 QUILT_ENGINE_TOKEN=... [QUILT_NULL_REDIS=1 REDIS_URL=redis://...] \\
        python -m uvicorn benchmarks.null_proxy:app --port 8300

Served by uvicorn as the gateway is (`gateway_overhead.GATEWAY_HTTP`). Not for users: every
other path answers 401, so `gateway_overhead.py` can wait for it as it waits for a gateway.
"""

import json
import os
import time
import uuid

import aiohttp

from gateway.admission.redis_client import ScriptCalls, loop_client

ENGINE_URL = os.environ.get("QUILT_NULL_ENGINE_URL", "") + "/v1/generate"
ENGINE_HEADERS = {"Authorization": f"Bearer {os.environ.get('QUILT_ENGINE_TOKEN', '')}",
                  "Content-Type": "application/json"}  # fmt: skip
REDIS = os.environ.get("QUILT_NULL_REDIS") == "1"
SCRIPT = "return 1"
ACQUIRE_ARGUMENT, SETTLE_ARGUMENT = b"a" * 600, b"s" * 1300  # about the size of admission's acquire and settle
SSE_HEAD = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]

_clients: list = []  # (aiohttp.ClientSession, (ScriptCalls, its script) | None), made on the server's loop at its first
# request


def _redis() -> tuple:
    url = os.environ["REDIS_URL"]
    return ScriptCalls(url, reply_seconds=5.0), loop_client(url, reply_seconds=5.0).register_script(SCRIPT)


async def _body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _chunk(request_id: str, created: int, model: str, text: str) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
    body = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    raw = await _body(receive)
    if scope["path"] != "/v1/completions" or scope["method"] != "POST":
        await send({"type": "http.response.start", "status": 401, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"error": {"message": "null proxy"}}'})
        return
    if not _clients:
        engine = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0),
                                       timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=60.0),
                                       auto_decompress=False, skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"))  # fmt: skip
        _clients.append((engine, _redis() if REDIS else None))
    engine, redis = _clients[0]
    request = json.loads(raw)
    request_id, created = uuid.uuid4().hex, int(time.time())
    if redis is not None:
        await redis[0](redis[1], [], [ACQUIRE_ARGUMENT])
    payload = {"request_id": request_id, "tenant": "null", "prompt": request["prompt"], "stream": True,
               "sampling": {"max_tokens": request.get("max_tokens") or 16, "temperature": request.get("temperature", 1.0)}}  # fmt: skip
    response = await engine.post(ENGINE_URL, data=json.dumps(payload).encode(), headers=ENGINE_HEADERS)
    started, rest = False, b""
    while data := await response.content.readany():
        lines = (rest + data).split(b"\n")
        rest = lines.pop()
        chunks = []
        for line in lines:
            event = json.loads(line) if line else {}
            if event.get("type") == "delta":
                chunks.append(_chunk(request_id, created, request["model"], event.get("text", "")))
        if chunks:
            if not started:
                await send({"type": "http.response.start", "status": 200, "headers": SSE_HEAD})
                started = True
            await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": True})
    if redis is not None:
        await redis[0](redis[1], [], [SETTLE_ARGUMENT])
    if not started:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEAD})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
