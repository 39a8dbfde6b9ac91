"""The gateway's client to its engines, library against library: the same streamed generate requests to
benchmarks/instant_engine.py (an engine that answers at once, in a process of its own) through aiohttp and httpx,
and as messages on the engine's generate channel (aiohttp's websocket, the gateway's `gateway.engine_channel`), in
this one process, on asyncio's loop and on uvloop's, and the CPU this process spends per request.

    python -m benchmarks.engine_client_libs [--requests 2000] [--streams 1,50] [--rounds 3]

Each request is what the gateway sends: a POST of a compact JSON payload with the engine's token, its answer an
NDJSON stream of `max_tokens` deltas and a final event, read as it arrives and split into lines, each decoded.
Every client keeps one pool of keep-alive connections for all its requests (as the gateway keeps one per event
loop). The libraries alternate round by round so that each sees the same machine; the figure is the median round,
with the spread (lowest to highest) beside it. Nothing is asserted.
"""

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import msgspec
import uvloop

from benchmarks.instant_engine import HTTP as INSTANT_HTTP
from engine.contract.channel import CHANNEL_PATH

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "platform"))  # gateway.engine_channel
TOKEN = "bench-engine-token"
PAYLOAD = {"request_id": "0" * 32, "tenant": "bench", "prompt": "w10 w11 w12", "stream": True,
           "sampling": {"max_tokens": 16, "temperature": 1.0}, "adapter": None}  # fmt: skip
HEADERS = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
decode = msgspec.json.decode


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def lines_of(rest: bytes, chunk: bytes) -> tuple[bytes, int]:
    """What is left after the chunk's complete lines, and how many events they held."""
    parts = (rest + chunk).split(b"\n")
    rest = parts.pop()
    return rest, sum(1 for line in parts if line and decode(line))


async def aiohttp_requests(url: str, count: int, streams: int) -> tuple[int, float]:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)  # the session as gateway.engine_client makes it
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=60.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                     skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
                                     cookie_jar=aiohttp.DummyCookieJar()) as session:  # fmt: skip

        async def one() -> int:
            body = msgspec.json.encode(PAYLOAD)
            async with session.post(url, data=body, headers=HEADERS) as response:
                rest, events = b"", 0
                while chunk := await response.content.readany():  # as engine_client.Body reads it
                    rest, more = lines_of(rest, chunk)
                    events += more
                return events

        return await run_all(one, count, streams)


async def httpx_requests(url: str, count: int, streams: int) -> tuple[int, float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=streams, keepalive_expiry=2.0)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(60.0, connect=5.0)) as client:

        async def one() -> int:
            body = msgspec.json.encode(PAYLOAD)
            async with client.stream("POST", url, content=body, headers=HEADERS) as response:
                rest, events = b"", 0
                async for chunk in response.aiter_raw():
                    rest, more = lines_of(rest, chunk)
                    events += more
                return events

        return await run_all(one, count, streams)


async def channel_requests(url: str, count: int, streams: int) -> tuple[int, float]:
    from gateway.engine_channel import channel_to

    base = url.removesuffix("/v1/generate")
    async with aiohttp.ClientSession() as session:
        channel = await channel_to(session, base + CHANNEL_PATH, HEADERS, (base, CHANNEL_PATH, TOKEN))
        numbers = iter(range(10**9))

        async def one() -> int:
            request_id = f"{next(numbers):032x}"
            body = await channel.send(request_id, msgspec.json.encode(PAYLOAD | {"request_id": request_id}),
                                      read_timeout=60.0)  # fmt: skip
            events = 0
            while not body.complete or body.lines:
                await body.arrival()
                while body.lines:
                    events += bool(decode(body.lines.popleft()))
            body.close()
            return events

        try:
            return await run_all(one, count, streams)
        finally:
            await channel.ws.close()


async def run_all(one, count: int, streams: int) -> tuple[int, float]:
    """The events read and the CPU seconds spent by `count // streams` requests on each of `streams` at once."""

    async def worker(share: int) -> int:
        return sum([await one() for _ in range(share)])

    await asyncio.gather(*(one() for _ in range(streams)))  # the connections made, outside the measure
    started = time.process_time()
    events = sum(await asyncio.gather(*(worker(count // streams) for _ in range(streams))))
    return events, time.process_time() - started


CLIENTS = {"aiohttp": aiohttp_requests, "httpx": httpx_requests, "channel": channel_requests}
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def measure(client: str, loop: str, url: str, count: int, streams: int) -> float:
    """This process's CPU (user + system) per request, in ms."""
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        events, spent = runner.run(CLIENTS[client](url, count, streams))
    requests = count // streams * streams
    assert events == requests * 17, events  # 16 deltas and the final event each
    return spent / requests * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--streams", default="1,50", help="concurrent streams, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "uvicorn", "benchmarks.instant_engine:app", *INSTANT_HTTP,
                               "--port", str(port), "--log-level", "warning", "--no-access-log",
                               "--timeout-keep-alive", "75"],
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1/generate"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or engine.poll() is not None:
                    raise SystemExit("the instant engine did not start") from None
                time.sleep(0.2)
        cases = [(client, loop) for loop in LOOPS for client in CLIENTS]
        for streams in map(int, args.streams.split(",")):
            figures: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
            for _ in range(args.rounds):
                for case in cases:
                    figures[case].append(measure(*case, url, args.requests, streams))
            print(f"\n{streams} stream(s), {args.requests} requests a round, {args.rounds} rounds: "
                  "client CPU ms per request, median (lowest-highest)")  # fmt: skip
            medians = {case: statistics.median(values) for case, values in figures.items()}
            for (client, loop), values in figures.items():
                print(f"  {client:8} {loop:8} {medians[client, loop]:.3f} ({min(values):.3f}-{max(values):.3f})")
            for loop in LOOPS:
                print(f"  httpx / aiohttp on {loop}: {medians['httpx', loop] / medians['aiohttp', loop]:.2f}x")
                print(f"  channel / aiohttp on {loop}: {medians['channel', loop] / medians['aiohttp', loop]:.2f}x")
    finally:
        engine.terminate()
        engine.wait()


if __name__ == "__main__":
    main()
