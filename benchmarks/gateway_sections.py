"""Where a streamed request's gateway CPU goes, without uvicorn or a client: `gateway.asgi.application` called
in-process, one request after another, against benchmarks/instant_engine.py, PostgreSQL and Redis as
gateway_overhead.py sets them up.

    python -m benchmarks.gateway_sections [--requests 3000] [--rounds 3] [--database quilt_sections] [--profile PATH]
                                          [--opcodes N [--opcodes-top K]]

Prints, per round, this process's CPU per request (time.process_time; how much of it in the event loop's thread,
the rest in the threads beside it) and each section's thread CPU per request,
inclusive of what it awaits (the event loop's work for its socket reads and writes included): admission's two
Redis scripts, the engine's request and its first event, the relay to the end (the settle included). The difference
between this CPU and gateway_overhead.py's figure is uvicorn's and the client connection's share. `--profile` runs
the last round under cProfile (CPU clock, builtins folded into their callers) and writes the stats. `--opcodes N`
then runs N more requests under a tracer and prints the Python calls and bytecode instructions per request: a count
that the machine's load does not change (C code, the kernel and Redis are not in it); `--opcodes-top K` adds the K
functions that execute the most (where a hot loop shows first). Nothing is asserted.
"""

import argparse
import asyncio
import collections
import cProfile
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks import gateway_overhead as overhead
from benchmarks.instant_engine import HTTP as INSTANT_HTTP

REPO = Path(__file__).resolve().parents[1]


def _timed(owner, name: str, totals: dict[str, int], label: str) -> None:
    """Wraps the coroutine function `owner.name` to add its thread CPU to totals[label]."""
    function = getattr(owner, name)

    async def timed(*args, **kwargs):
        started = time.thread_time_ns()
        try:
            return await function(*args, **kwargs)
        finally:
            totals[label] = totals.get(label, 0) + time.thread_time_ns() - started

    setattr(owner, name, timed)


async def _measure(args, key: str) -> None:
    from gateway import admit, asgi, exchange, generation, relay
    from gateway.engine_client import GenerateStream

    totals: dict[str, int] = {}
    for owner, name, label in (
        (generation, "admit", "parse+auth+admit"), (admit, "admission_admit", "  admission (lease or script)"),
        (relay, "open_stream", "route+engine+first event"), (GenerateStream, "open", "  engine request"),
        (asgi, "_send_chunks", "relay to the end"), (exchange.Exchange, "settle", "  settle"),
        (exchange, "admission_settle", "    settle script"),
    ):  # fmt: skip
        _timed(owner, name, totals, label)
        totals[label] = 0  # printed in this order
    body = json.dumps({"model": "bench", "prompt": overhead.PROMPT, "max_tokens": args.max_tokens, "stream": True,
                       "temperature": 0}).encode()  # fmt: skip
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"), (b"accept", b"*/*"),
               (b"authorization", f"Bearer {key}".encode()), (b"content-length", str(len(body)).encode())]  # fmt: skip
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}  # fmt: skip

    async def one() -> None:
        sent, received = [], []

        async def receive():
            if not received:
                received.append(True)
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client never goes away

        async def send(message):
            sent.append(message)

        await asgi.application(dict(scope), receive, send)
        assert sent[0]["status"] == 200 and sent[-1]["body"].endswith(b"data: [DONE]\n\n"), sent

    for _ in range(300):
        await one()
    await asyncio.sleep(1.1)
    for number in range(args.rounds):
        profiler = cProfile.Profile(time.process_time, builtins=False) if args.profile and number == args.rounds - 1 else None
        totals.update(dict.fromkeys(totals, 0))
        started, main_started = time.process_time(), time.thread_time()
        if profiler:
            profiler.enable()
        for _ in range(args.requests):
            await one()
        if profiler:
            profiler.disable()
            profiler.dump_stats(args.profile)
        main_us = (time.thread_time() - main_started) / args.requests * 1e6
        cpu_us = (time.process_time() - started) / args.requests * 1e6
        print(f"round {number}{' (profiled)' if profiler else ''}: {cpu_us:.0f} us of CPU per request"
              f" ({main_us:.0f} in the event loop's thread, {cpu_us - main_us:.0f} in the others)", flush=True)
        for label, nanoseconds in totals.items():
            print(f"  {label:<28} {nanoseconds / args.requests / 1000:6.0f} us", flush=True)
    if args.opcodes:
        await _count_opcodes(one, args.opcodes, args.opcodes_top)


async def _count_opcodes(one, requests: int, top: int = 0) -> None:
    """Python function calls and bytecode instructions executed in this thread per request (the benchmark's own
    `one` included, the same in every checkout); with `top`, the functions that execute the most of them."""
    counts = {"call": 0, "opcode": 0}
    by_function: collections.Counter[str] = collections.Counter()

    def trace(frame, event, arg):
        if event == "call":
            counts["call"] += 1
            frame.f_trace_opcodes = True
        elif event == "opcode":
            counts["opcode"] += 1
            if top:
                code = frame.f_code
                where = "/".join(code.co_filename.split("/")[-2:])
                if where == "<string>":  # code that dataclasses generate: named by its class
                    where = "<string> " + type(frame.f_locals.get("self")).__qualname__
                by_function[where + ":" + code.co_name] += 1
        return trace

    sys.settrace(trace)
    try:
        for _ in range(requests):
            await one()
    finally:
        sys.settrace(None)
    print(f"traced {requests} requests: {counts['call'] / requests:.1f} Python calls (frames entered or resumed) and "
          f"{counts['opcode'] / requests:.0f} bytecode instructions per request", flush=True)  # fmt: skip
    for name, count in by_function.most_common(top):
        print(f"  {count / requests:8.0f} {name}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000, help="per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--database", default="quilt_sections", help="PostgreSQL database to (re)create and use")
    parser.add_argument("--opcodes", type=int, default=0, help="then count bytecode instructions over this many requests")
    parser.add_argument("--opcodes-top", type=int, default=0,
                        help="with --opcodes: also the functions executing the most bytecodes, this many")
    parser.add_argument("--profile", type=Path, help="profile the last round with cProfile, writing its stats here")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="quilt-gateway-sections-"))
    sys.path.insert(0, str(REPO))
    from tests.engine.conftest import build_checkpoint

    model_dir = build_checkpoint(work / "model", "llama", seed=3)  # registered only: the stand-in never reads it
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "quilt.settings.test",
           "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{args.database}", "REDIS_URL": "redis://127.0.0.1:6379/12",
           "QUILT_REDIS_KEY_PREFIX": f"sections-{uuid.uuid4().hex[:8]}", "MEDIA_ROOT": str(work / "media"),
           "QUILT_ENGINE_TOKEN": overhead.TOKEN, "LOG_LEVEL": "WARNING"}  # fmt: skip
    os.environ.update({name: env[name] for name in ("QUILT_REDIS_KEY_PREFIX", "LOG_LEVEL")})
    overhead.setup_django(env, args.database)
    port = overhead.free_port()
    engine = subprocess.Popen([sys.executable, "-m", "uvicorn", "benchmarks.instant_engine:app", *INSTANT_HTTP, "--port", str(port),
                               "--log-level", "warning", "--no-access-log"], cwd=REPO, env={**env, "CELERY_BROKER_URL": ""})  # fmt: skip
    try:
        overhead.wait_http(f"http://127.0.0.1:{port}/v1/health", (200,), engine)
        key = overhead.seed(model_dir, f"http://127.0.0.1:{port}")
        import uvloop  # as uvicorn runs the gateway

        uvloop.run(_measure(args, key))
    finally:
        engine.terminate()
        engine.wait(timeout=30)


if __name__ == "__main__":
    main()
