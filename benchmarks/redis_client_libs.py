"""Admission's two Redis calls per request (the acquire script, then the settle script) through redis-py's asyncio
client with its hiredis parser, as `gateway.admission.redis_backend` makes them, side by side with a hand-written
RESP client (`redis_wire.py` and the backend that drove it, read from git at `--old`), on the same
Redis, the same scripts, keys and arguments, in one process on uvloop.

    python -m benchmarks.redis_client_libs [--redis redis://127.0.0.1:6379/14] [--requests 3000] [--rounds 3]

CPU time of this process (time.process_time) per request (acquire + settle), in µs, with 1 request at a time and with
50 at once; Redis's own CPU is not counted. The hand-written client's modules are loaded under their names at `--old` from `git show`, so
this runs from any checkout of the repository. Nothing is asserted.
"""

import argparse
import asyncio
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "quilt.settings.test")

import django  # noqa: E402

django.setup()

import redis  # noqa: E402
import uvloop  # noqa: E402

from gateway.admission.limits import UNLIMITED, Limits  # noqa: E402
from gateway.admission.redis_backend import RedisAdmission  # noqa: E402

OLD = "1e502d0"  # the last commit with the gateway's own RESP client
LIMITS = Limits(10**9, 10**12, 10**6, UNLIMITED, UNLIMITED, "benchkey", UNLIMITED, UNLIMITED, UNLIMITED)
USAGE = '{"prompt_tokens": 12, "completion_tokens": 16, "total_tokens": 28}'


def _module(name: str, source: str, folder: Path) -> types.ModuleType:
    path = folder / f"{name.rsplit('.', 1)[-1]}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def old_admission_class(revision: str) -> type:
    """The hand-written client's RedisAdmission, on its own wire, both as they are at `revision`."""

    def source(path: str) -> str:
        return subprocess.run(["git", "show", f"{revision}:{path}"], cwd=REPO, check=True, capture_output=True,
                              text=True).stdout  # fmt: skip

    folder = Path(tempfile.mkdtemp(prefix="old-redis-wire-"))
    _module("gateway.admission.redis_wire", source("platform/gateway/admission/redis_wire.py"), folder)
    if importlib.util.find_spec("gateway.running_loop") is None:
        _module("gateway.running_loop", source("platform/gateway/running_loop.py"), folder)
    backend = _module("old_redis_backend", source("platform/gateway/admission/redis_backend.py"), folder)
    return backend.RedisAdmission


async def _request(admission, tenant_id: int) -> None:
    request_id = uuid.uuid4().hex
    decision = await admission.acquire(tenant_id=tenant_id, request_id=request_id, tokens=28, spend_micros=3,
                                       key_spend_picos=3_000_000, limits=LIMITS)  # fmt: skip
    assert decision.admitted, decision
    await admission.settle(tenant_id=tenant_id, request_id=request_id, tokens=28, spend_micros=3,
                           key_spend_picos=3_000_000, final=True, key_prefix="benchkey", usage=USAGE)  # fmt: skip


async def _measure(admission, tenant_id: int, requests: int, streams: int) -> float:
    """CPU µs per request with `streams` requests at a time."""

    async def stream(count: int) -> None:
        for _ in range(count):
            await _request(admission, tenant_id)

    await asyncio.gather(*(stream(20) for _ in range(streams)))  # connections opened, scripts cached
    started = time.process_time()
    await asyncio.gather(*(stream(requests // streams) for _ in range(streams)))
    return (time.process_time() - started) / (requests // streams * streams) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis", default=os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379") + "/14")
    parser.add_argument("--old", default=OLD, help="the git revision whose redis_wire.py to measure against")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    prefix = f"quilt-bench-{uuid.uuid4().hex[:8]}"
    clients = {"own RESP client": old_admission_class(args.old), "redis-py + hiredis": RedisAdmission}
    results: dict[tuple[str, int], list[float]] = {}
    client = redis.Redis.from_url(args.redis)
    keys = RedisAdmission(url=args.redis, prefix=prefix).keys(1)
    client.hset(keys[4], mapping={"tokens": 0, "picos": 0})  # the month started, as metering's record would
    client.hset(keys[9], "benchkey:picos", 0)
    try:
        for round_ in range(args.rounds):
            for streams in (1, 50):
                for name, admission_class in clients.items():
                    admission = admission_class(url=args.redis, prefix=prefix, hold_ttl_seconds=900)
                    cpu = uvloop.run(_measure(admission, 1, args.requests, streams))
                    results.setdefault((name, streams), []).append(cpu)
                    print(f"round {round_}, {streams} at once, {name}: {cpu:.1f} µs CPU per request", flush=True)
    finally:
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
    print("\nµs CPU per request (acquire + settle), median of the rounds [min-max]:")
    for streams in (1, 50):
        row = {name: results[(name, streams)] for name in clients}
        old, new = (statistics.median(values) for values in row.values())
        spread = "; ".join(f"{name} {statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}]" for name, v in row.items())
        print(f"{streams:>2} at once: {spread}; ratio {new / old:.2f}")


if __name__ == "__main__":
    main()
