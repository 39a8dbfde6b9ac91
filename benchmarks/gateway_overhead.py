"""What the gateway adds: the same streamed requests, to the same engine, directly and through the gateway.

    python benchmarks/gateway_overhead.py [--levels 1,50,200] [--requests 400] [--model DIR] [--engine instant]

Starts PostgreSQL-backed Django state (database `quilt_bench` or --database, dropped and recreated), Redis admission (db 12),
one engine on a tiny random Llama (or --model; or, with `--engine instant`, benchmarks/instant_engine.py, a
stand-in that answers at once, so that the figures are the gateway's own cost) and one gateway under uvicorn;
the tenant has rate limits and a monthly token budget and spend limit, so admission runs every check. At each
concurrency level it
runs the requests directly against the engine's /v1/generate and through the gateway's /v1/completions
(streaming), alternating the two so that both see the same machine. Prints p50/p99 time to first token each
way, the added p50/p99, and the gateway's requests per second. Nothing is asserted. The load's client is
benchmarks/lean_client.py (`--client httpx` for httpx's, which takes a core of its own at 50 streams and cannot keep
them in flight: docs/gateway-performance.md, "The load's client").

With `--null-proxy`, two more columns run beside the gateway: benchmarks/null_proxy.py, a proxy of the same route
with none of the gateway's own work ("null"), and the same with two Redis round trips a request ("null+redis"): the
floor any Python proxy of this stream has on this machine, and what the gateway adds to it.
"""

import argparse
import asyncio
import collections
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from benchmarks.instant_engine import HTTP as INSTANT_HTTP
from benchmarks.lean_client import LeanClient, ResponseFailed, prepared_request
from benchmarks.proc_stats import cpu_seconds, io_counts, load_average, machine_ticks, main_thread_seconds

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-engine-token"
KEEP_ALIVE_SECONDS = 75  # the gateway's --timeout-keep-alive in docker/compose.yaml
PROMPT = "w10 w11 w12"
IDLE_SECONDS = 5.0
GATEWAY_HTTP = ("--http", "httptools", "--loop", "uvloop")  # docker/compose.yaml's: uvicorn's fastest protocol and loop
OWN_PROTOCOL = "gateway.http_protocol:GatewayHttpProtocol"  # a baseline tree's own server protocol (bcc7bf5 has one)
# uvicorn's options the gateway is measured with (`serve` below passes them; --timeout-keep-alive is --keep-alive's,
# 75 by default), each with its value or None: the deployed gateway's too (compose, Kubernetes, the platform image),
# which tests/platform/test_settings_and_deploy.py holds to these
GATEWAY_SERVER_OPTIONS = (("--http", "httptools"), ("--loop", "uvloop"), ("--no-access-log", None),
                          ("--timeout-keep-alive", str(KEEP_ALIVE_SECONDS)))  # fmt: skip



def gateway_server_flags(tree: Path) -> list[str]:
    """uvicorn's --http and --loop for the gateway of `tree`, as that tree deploys it: a tree with a server protocol
    of its own (gateway/http_protocol.py, a baseline's) runs under it."""
    if (tree / "platform/gateway/http_protocol.py").exists():
        return ["--http", OWN_PROTOCOL]
    return list(GATEWAY_HTTP)

PROFILED = """import cProfile, signal, sys, time, uvicorn.main
profiler = cProfile.Profile(time.process_time)  # CPU time, not time waiting
signal.raise_signal = lambda sig: profiler.dump_stats({path!r})
sys.argv[0] = "uvicorn"
profiler.enable()
try:
    uvicorn.main.main(standalone_mode=False)
finally:
    profiler.disable()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, ok: tuple[int, ...], process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url}: the process exited with {process.returncode}")
        try:
            if httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=1).status_code in ok:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer")


def setup_django(env: dict, database: str) -> None:
    os.environ.update({k: env[k] for k in ("DJANGO_SETTINGS_MODULE", "DATABASE_URL", "REDIS_URL", "MEDIA_ROOT", "QUILT_ENGINE_TOKEN")})
    sys.path[:0] = [str(REPO), str(REPO / "platform")]
    import psycopg

    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{database}"')
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def seed(model_dir: Path, engine_url: str) -> str:
    from django.core.management import call_command

    from apikeys.models import ApiKey
    from gateway.services import engine_register
    from tenancy.audit import Actor
    from tenancy.models import Plan, Tenant

    call_command("registerbasemodel", "bench", str(model_dir), verbosity=0)
    plan = Plan.objects.create(slug="bench", name="Bench", requests_per_minute=10**7, tokens_per_minute=10**9,
                               max_concurrent_requests=10_000, monthly_token_budget=10**12,
                               monthly_spend_limit=10**9)  # fmt: skip
    tenant = Tenant.objects.create(slug="bench", name="Bench", plan=plan)
    _, key = ApiKey.objects.create_key(tenant=tenant, name="bench", scopes=["inference"])
    engine = engine_register(actor=Actor.system(), name="bench-engine", url=engine_url)
    assert engine.healthy, engine.last_error
    return key


def direct_body(request_id: str, max_tokens: int) -> dict:
    """The engine's /v1/generate request of the direct path (either client's)."""
    return {"request_id": request_id, "tenant": "bench", "prompt": PROMPT, "stream": True,
            "sampling": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}  # fmt: skip


def gateway_body(max_tokens: int) -> dict:
    """The gateway's /v1/completions request (either client's)."""
    return {"model": "bench", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}


async def first_token_direct(client: httpx.AsyncClient, url: str, max_tokens: int) -> float:
    body = direct_body(uuid.uuid4().hex, max_tokens)
    started = time.perf_counter()
    ttft = None
    async with client.stream("POST", f"{url}/v1/generate", json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        async for line in r.aiter_lines():
            if ttft is None and line and json.loads(line).get("type") == "delta":
                ttft = time.perf_counter() - started
    return ttft


async def first_token_gateway(client: httpx.AsyncClient, url: str, key: str, max_tokens: int) -> float:
    body = gateway_body(max_tokens)
    started = time.perf_counter()
    ttft = None
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.perf_counter() - started
    return ttft


class LeanCalls:
    """`first_token_direct` and `first_token_gateway` through the lean client (`benchmarks.lean_client`): each
    request built once (the direct request's id replaced per request)."""

    def __init__(self, client: LeanClient, engine_url: str, key: str, max_tokens: int):
        self.client, self.engine_url = client, engine_url
        body = direct_body(_ID_PLACEHOLDER, max_tokens)
        self.direct_request = prepared_request(f"{engine_url}/v1/generate", json_body=body,
                                               headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
        self.key, self.max_tokens, self.gateway_requests = key, max_tokens, {}

    async def direct(self) -> float:
        started = time.perf_counter()
        body = self.direct_request.body.replace(_ID_PLACEHOLDER.encode(), uuid.uuid4().hex.encode(), 1)
        return _first(await self.client.post(self.direct_request, b'"delta"', body=body)) - started

    async def gateway(self, url: str) -> float:
        request = self.gateway_requests.get(url)
        if request is None:
            request = self.gateway_requests[url] = prepared_request(
                f"{url}/v1/completions", json_body=gateway_body(self.max_tokens),
                headers={"Authorization": f"Bearer {self.key}"})  # fmt: skip
        started = time.perf_counter()
        return _first(await self.client.post(request, b"data: {")) - started


def _first(arrived: float | None) -> float:
    if arrived is None:
        raise ResponseFailed("the response ended without an event")
    return arrived


_ID_PLACEHOLDER = "0" * 32  # a uuid4 hex's length: each request's body is as long

ERRORS: collections.Counter[str] = collections.Counter()  # transport failures (resets, ...) by path and type


async def run_level(call, concurrency: int, requests: int, path: str = "") -> tuple[list[float], float]:
    queue = list(range(requests))
    ttfts: list[float] = []

    async def worker():
        while queue:
            queue.pop()
            try:
                ttfts.append(await call())
            except (httpx.TransportError, OSError) as error:  # counted and shown, not fatal: a run reports how often
                # (the lean client's broken connections are ResponseFailed, a ConnectionError)
                ERRORS[f"{path}: {type(error).__name__} {error}"[:160]] += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ttfts, requests / (time.perf_counter() - started)


def python_version(python: str) -> str:
    """The interpreter's version, as `python -V` says it."""
    return subprocess.run([python, "-V"], capture_output=True, text=True, check=True).stdout.strip()


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def measure(args, engine_url: str, gateways: dict[str, tuple[str, int]], key: str, engine_pid: int) -> list[dict]:
    """`gateways`: name -> (url, pid); each level alternates direct and every gateway, round by round. The engine's
    own CPU per direct request (`engine_pid`: the instant stand-in, a uvicorn process answering at once) is the
    machine's yardstick: machines of one kind differ by 2-3x in CPU per request (docs/gateway-cpu.md), and the
    gateway's figure divided by it travels between them better than either alone."""
    # Idle connections expire long before the servers' keep-alive timeout, which would otherwise close one just as a
    # request goes out on it (a reset: httpx.ReadError). The server's idle clock starts when it sent the response's
    # end, this client's when it read it: with hundreds of streams this client lags seconds behind, so against
    # uvicorn's default 5 s that race happened at 200 streams (docs/gateway-performance.md).
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000, keepalive_expiry=1.0)
    rows = []
    lean = LeanCalls(LeanClient(), engine_url, key, args.max_tokens)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        direct = lambda: first_token_direct(client, engine_url, args.max_tokens)  # noqa: E731
        if args.client == "lean":
            direct = lean.direct
        baselines = list(gateways)[1 : 1 + len(args.baseline_client)]
        clients = {name: args.client for name in gateways} | dict(zip(baselines, args.baseline_client, strict=True))
        calls = {name: (lambda url=url: lean.gateway(url)) if clients[name] == "lean" else
                       (lambda url=url: first_token_gateway(client, url, key, args.max_tokens))
                 for name, (url, _) in gateways.items()}  # fmt: skip
        await run_level(direct, 4, args.warmup)
        for call in calls.values():
            await run_level(call, 4, args.warmup)  # warm every path (and let each gateway's first flushes pass)
        await asyncio.sleep(1.0)
        # What a gateway spends with no request at all (its threads' and timers' work): part of every figure below,
        # in proportion to how long a round lasts, so a slower machine (or a busier one) reads a higher CPU per
        # request for the same per-request work.
        idle = {name: cpu_seconds(pid) for name, (_, pid) in gateways.items()}
        await asyncio.sleep(IDLE_SECONDS)
        idle = {name: sum(cpu_seconds(gateways[name][1])) - sum(before) for name, before in idle.items()}
        for name, seconds in idle.items():
            print(f"{name:>8} idle: {seconds / IDLE_SECONDS * 1000:.1f} ms of CPU per second", flush=True)
        for level in args.levels:
            requests = max(args.requests, level)
            load_before, ticks_before = load_average(), machine_ticks()
            # Each level's own warm-up, not measured: its connections opened (client to gateway, gateway to engine
            # and Redis), so no round pays for them.
            await run_level(direct, level, max(level, args.warmup))
            for call in calls.values():
                await run_level(call, level, max(level, args.warmup))
            direct_ttfts, engine_cpu, engine_writes = [], 0.0, 0
            ttfts = {name: [] for name in gateways}
            rps = {name: [] for name in gateways}
            cpu = {name: [0.0, 0.0] for name in gateways}  # user, system
            per_round = {name: [] for name in gateways}  # CPU per request (ms), each round
            main_thread = {name: 0.0 for name in gateways}
            counts = {name: [0, 0, 0] for name in gateways}  # reads, writes, wake-ups
            wall = {name: 0.0 for name in gateways}
            for number in range(args.rounds):  # alternate, so all see the same machine
                engine_before, engine_io_before = sum(cpu_seconds(engine_pid)), io_counts(engine_pid)
                direct_ttfts += (await run_level(direct, level, requests // args.rounds, "direct"))[0]
                engine_cpu += sum(cpu_seconds(engine_pid)) - engine_before
                engine_writes += io_counts(engine_pid)[1] - engine_io_before[1]
                order = list(calls.items())
                for name, call in order[::-1] if number % 2 else order:  # neither gateway always goes first
                    pid = gateways[name][1]
                    cpu_before, main_before, started = cpu_seconds(pid), main_thread_seconds(pid), time.perf_counter()
                    io_before = io_counts(pid)
                    level_ttfts, level_rps = await run_level(call, level, requests // args.rounds, name)
                    wall[name] += time.perf_counter() - started
                    counts[name] = [total + after - before
                                    for total, after, before in zip(counts[name], io_counts(pid), io_before, strict=True)]
                    used = [after - before for after, before in zip(cpu_seconds(pid), cpu_before, strict=True)]
                    cpu[name] = [total + part for total, part in zip(cpu[name], used, strict=True)]
                    main_thread[name] += main_thread_seconds(pid) - main_before
                    per_round[name].append(sum(used) / max(len(level_ttfts), 1) * 1000)
                    ttfts[name] += level_ttfts
                    rps[name].append(level_rps)
            total, stolen = (after - before for after, before in zip(machine_ticks(), ticks_before, strict=True))
            load = (load_before, load_average())
            print(f"  level {level}: load average {load[0]:.1f} -> {load[1]:.1f}, {stolen / max(total, 1):.1%} of"
                  " the CPUs' time stolen by the hypervisor", flush=True)  # fmt: skip
            for name in gateways:
                row = {"gateway": name, "concurrency": level, "requests": len(ttfts[name]), "load": load,
                       "steal_share": stolen / max(total, 1)}  # fmt: skip
                for path, values in (("direct", direct_ttfts), ("gateway", ttfts[name])):
                    row[f"{path}_p50_ms"] = percentile(values, 50) * 1000
                    row[f"{path}_p99_ms"] = percentile(values, 99) * 1000
                row["added_p50_ms"] = row["gateway_p50_ms"] - row["direct_p50_ms"]
                row["added_p99_ms"] = row["gateway_p99_ms"] - row["direct_p99_ms"]
                row["gateway_rps"] = statistics.mean(rps[name])
                # The gateway's own CPU per request: what bounds one gateway process's rate on a core of its own,
                # whatever else shares this machine. Over all rounds, and each round's (median, least, most): /proc
                # counts in 10 ms ticks, so a round should last seconds.
                row["gateway_cpu_ms"] = sum(cpu[name]) / len(ttfts[name]) * 1000
                row["round_cpu_ms"] = per_round[name]
                row["round_cpu_median_ms"] = statistics.median(per_round[name])
                row["main_thread_share"] = main_thread[name] / sum(cpu[name]) if sum(cpu[name]) else 0.0
                row["gateway_system_share"] = cpu[name][1] / sum(cpu[name]) if sum(cpu[name]) else 0.0
                row["capacity_rps"] = 1000 / row["gateway_cpu_ms"] if row["gateway_cpu_ms"] else float("inf")
                row["idle_cpu_ms"] = idle[name] / IDLE_SECONDS * wall[name] / len(ttfts[name]) * 1000
                row["engine_cpu_ms"] = engine_cpu / max(len(direct_ttfts), 1) * 1000  # the yardstick
                row["engine_writes"] = engine_writes / max(len(direct_ttfts), 1)  # its framing (all its threads)
                row["gateway_per_engine"] = row["gateway_cpu_ms"] / row["engine_cpu_ms"] if engine_cpu else 0.0
                row["reads"], row["writes"], row["wakeups"] = (count / len(ttfts[name]) for count in counts[name])
                row["errors"] = sum(n for what, n in ERRORS.items() if what.startswith(f"{name}:"))
                rows.append(row)
                print(
                    f"{name:>8} concurrency {level:4d}: TTFT direct p50 {row['direct_p50_ms']:8.2f} ms"
                    f" p99 {row['direct_p99_ms']:8.2f} ms"
                    f" | gateway p50 {row['gateway_p50_ms']:8.2f} ms p99 {row['gateway_p99_ms']:8.2f} ms"
                    f" | added p50 {row['added_p50_ms']:+7.2f} ms p99 {row['added_p99_ms']:+7.2f} ms"
                    f" | gateway {row['gateway_rps']:7.1f} req/s"
                    f" | gateway CPU {row['gateway_cpu_ms']:.2f} ms/request, rounds median"
                    f" {row['round_cpu_median_ms']:.2f} ({min(per_round[name]):.2f}-{max(per_round[name]):.2f})"
                    f" (one core: {row['capacity_rps']:.0f} req/s, {row['gateway_system_share']:.0%} in the kernel,"
                    f" {row['main_thread_share']:.0%} in the main thread, {row['idle_cpu_ms']:.2f} ms of it the idle rate)"
                    f" | per request {row['reads']:.2f} reads, {row['writes']:.2f} writes, {row['wakeups']:.2f} wake-ups"
                    f" | the engine's CPU per direct request {row['engine_cpu_ms']:.2f} ms and"
                    f" {row['engine_writes']:.2f} writes (the yardstick):"
                    f" gateway/engine {row['gateway_per_engine']:.2f}"
                    + (f" | {row['errors']} transport errors" if row["errors"] else ""),
                    flush=True,
                )
            if len(gateways) > 1:
                first, *others = gateways
                for other in others:
                    ratios = [a / b for a, b in zip(per_round[first], per_round[other], strict=True) if b]
                    print(f"  {first}/{other} CPU per request, round by round: median {statistics.median(ratios):.3f}"
                          f" ({min(ratios):.3f}-{max(ratios):.3f})", flush=True)  # fmt: skip
            for what, count in ERRORS.items():
                print(f"  {count} x {what}", flush=True)
            ERRORS.clear()
    await lean.client.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,50,200", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--requests", type=int, default=400, help="per level and path (at least the level)")
    parser.add_argument("--rounds", type=int, default=2, help="direct/gateway alternations per level")
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=200,
                        help="requests per path before measuring, and again at each level (not measured)")
    parser.add_argument("--model", type=Path, help="a Llama checkpoint folder (default: a tiny random one)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--engine", choices=("real", "instant"), default="real",
                        help="instant: the stand-in that answers at once (the gateway's own cost)")
    parser.add_argument("--database", default="quilt_bench", help="PostgreSQL database to (re)create and use")
    parser.add_argument("--baseline", type=Path, action="append", default=[],
                        help="a checkout of other code (e.g. `git archive COMMIT | tar -x -C DIR`): its gateway runs"
                             " beside this one's, on the same database, Redis and engine, alternating with it;"
                             " repeat it for more (baseline, baseline2, ...)")
    parser.add_argument("--baseline-python", type=Path, action="append", default=[],
                        help="the Python that runs the baseline of the same rank (default: this one), e.g. another"
                             " virtualenv's bin/python: two interpreters side by side on the same code")
    parser.add_argument("--client", choices=("lean", "httpx"), default="lean",
                        help="the load's client: lean (benchmarks/lean_client.py, aiohttp's, at a fraction of"
                             " httpx's CPU) or httpx")
    parser.add_argument("--baseline-client", choices=("lean", "httpx"), action="append", default=[],
                        help="the client of the baseline of the same rank (default: --client's)")
    parser.add_argument("--keep-alive", type=int, default=KEEP_ALIVE_SECONDS,
                        help="the gateways' and the instant engine's uvicorn --timeout-keep-alive (as deployed: 75)")
    parser.add_argument("--profile", type=Path, help="run the gateway under cProfile, writing its stats here")
    parser.add_argument("--null-proxy", action="store_true",
                        help="also measure benchmarks/null_proxy.py, without and with two Redis round trips a request")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="quilt-gateway-bench-"))
    model_dir = args.model
    if model_dir is None:  # registered as the base model (the instant stand-in never reads it)
        sys.path.insert(0, str(REPO))
        from tests.engine.conftest import build_checkpoint

        model_dir = build_checkpoint(work / "model", "llama", seed=3)
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "quilt.settings.test",
        "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{args.database}",
        "REDIS_URL": "redis://127.0.0.1:6379/12",
        "QUILT_REDIS_KEY_PREFIX": f"bench-{uuid.uuid4().hex[:8]}",
        "MEDIA_ROOT": str(work / "media"),
        "QUILT_ENGINE_TOKEN": TOKEN,
        "PYTHONPATH": f"{REPO}:{REPO / 'platform'}",
        "LOG_LEVEL": "WARNING",
    }
    setup_django(env, args.database)
    engine_port = free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    if args.engine == "instant":
        engine_command = ["-m", "uvicorn", "benchmarks.instant_engine:app", *INSTANT_HTTP, "--port", str(engine_port),
                          "--log-level", "warning", "--no-access-log", "--timeout-keep-alive", str(args.keep_alive)]  # fmt: skip
    else:
        engine_command = ["-m", "engine", "--model", str(model_dir), "--port", str(engine_port),
                          "--usage-spool", str(work / "spool.jsonl"), "--log-level", "warning"]  # fmt: skip
    # uvicorn re-raises the SIGTERM it caught once it has shut down, which would kill cProfile before it writes
    profile = ["-c", PROFILED.format(path=str(args.profile))] if args.profile else ["-m", "uvicorn"]
    trees = {"gateway": (REPO, profile, sys.executable)}
    pythons = [*args.baseline_python, *[Path(sys.executable)] * len(args.baseline)][: len(args.baseline)]
    for number, (baseline, python) in enumerate(zip(args.baseline, pythons, strict=True), start=1):
        trees["baseline" if number == 1 else f"baseline{number}"] = (baseline.resolve(), ["-m", "uvicorn"], str(python))
    processes = [subprocess.Popen([sys.executable, *engine_command], cwd=REPO, env={**env, "CELERY_BROKER_URL": ""})]
    gateways: dict[str, tuple[str, int]] = {}

    def serve(name: str, runner: list[str], application: list[str], cwd: Path, server_env: dict,
              python: str = sys.executable) -> None:
        """Starts `application` under uvicorn on a free port with the gateways' common flags, as `name`."""
        port = free_port()
        processes.append(subprocess.Popen(
            [python, *runner, *application, "--port", str(port), "--log-level", "warning", "--no-access-log",
             "--timeout-keep-alive", str(args.keep_alive)],
            cwd=cwd, env=server_env,
        ))  # fmt: skip
        gateways[name] = (f"http://127.0.0.1:{port}", processes[-1].pid)

    for name, (tree, runner, python) in trees.items():
        http = gateway_server_flags(tree)
        serve(name, runner, ["gateway.asgi:application", "--app-dir", str(tree / "platform"), *http], tree,
              {**env, "PYTHONPATH": f"{tree}:{tree / 'platform'}"}, python)  # fmt: skip
    for name, redis in (("null", "0"), ("null+redis", "1")) if args.null_proxy else ():
        serve(name, ["-m", "uvicorn"], ["benchmarks.null_proxy:app"], REPO,
              {**env, "QUILT_NULL_ENGINE_URL": engine_url, "QUILT_NULL_REDIS": redis})  # fmt: skip
    try:
        wait_http(f"{engine_url}/v1/health", (200,), processes[0])
        for (url, _), process in zip(gateways.values(), processes[1:], strict=True):
            wait_http(f"{url}/v1/models", (401,), process)
        key = seed(model_dir, engine_url)
        time.sleep(1.1)  # the gateway's engine list refreshes once a second
        print(f"engine {engine_url}, gateways {gateways}, max_tokens {args.max_tokens}, {os.cpu_count()} CPUs")
        if args.baseline_python:  # which interpreter runs which gateway
            print(", ".join(f"{name}: {python_version(python)} ({python})" for name, (_, _, python) in trees.items()))
        rows = asyncio.run(measure(args, engine_url, gateways, key, processes[0].pid))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)


if __name__ == "__main__":
    main()
