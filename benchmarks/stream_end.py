"""How long a stream's end takes after its text: p50 of (time of [DONE] - time of the last text chunk) against the
median inter-token interval, at 1, 8 and 32 streams, for this tree and a baseline, side by side in one run.

    git worktree add /work/wt-baseline bcc7bf5
    .venv/bin/python -m benchmarks.stream_end --baseline /work/wt-baseline --guidellm [--levels 1,8,32] [--requests 64]

Each tree runs its own stack as `make demo` runs it, on the embedded defaults (SQLite database, so admission's holds
and settles in the database, and the SQLite Celery broker), in a fresh folder: an engine on the demo model
(var/demo-model, built by `python -m engine.demo`), a gateway under uvicorn as that tree deploys it, and a Celery
worker that records the engines' usage events. One tenant, on a plan roomy enough not to refuse the load, streams
chat completions (max_tokens --max-tokens, the model free to end earlier with EOS, usage included, no extension
fields: the baseline refuses guidellm's `ignore_eos`, `stream_options.continuous_usage_stats` and its `GET /health`,
so the side-by-side load is this script's own httpx client). At each level the two trees take turns, --rounds
times, so that both see the same machine. With --guidellm, guidellm (requirements/dev.txt) then loads this tree
alone at each level, unmodified (ignore_eos: each request runs to --max-tokens), and the same gap is read from its
report: each request's last iteration ([DONE]) minus its last token iteration, against guidellm's median
inter-token latency. A stream's inter-token intervals are
the gaps between its text chunks; the goal is a p50 gap of at most 1.5 median intervals (one more decode step, the
one that produces EOS, is inherent). Prints one row per tree and level; nothing is asserted.
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.gateway_overhead import TOKEN, free_port, gateway_server_flags, wait_http
from benchmarks.work_folder import work_folder

REPO = Path(__file__).resolve().parents[1]
MODEL = "quilt-demo"
PROMPTS = ["the cat sees a red ball", "a dog runs to the park", "tell me about the sea", "one two three four"]
SEED = """
from console.management.commands.demo import broker_tables_create
from django.conf import settings
from django.core.management import call_command
from apikeys.models import ApiKey
from gateway.services import engine_register
from tenancy.audit import Actor
from tenancy.models import Plan, Tenant

broker_tables_create(settings.CELERY_BROKER_URL)
call_command("registerbasemodel", {model!r}, {model_dir!r}, verbosity=0)
plan = Plan.objects.create(slug="bench", name="Bench", requests_per_minute=10**7, tokens_per_minute=10**9,
                           max_concurrent_requests=10_000, monthly_token_budget=10**12, monthly_spend_limit=10**9)
tenant = Tenant.objects.create(slug="bench", name="Bench", plan=plan)
_, key = ApiKey.objects.create_key(tenant=tenant, name="bench", scopes=["inference"])
engine = engine_register(actor=Actor.system(), name="bench-engine", url={engine_url!r})
assert engine.healthy, engine.last_error
print("KEY=" + key)
"""


@dataclass
class Stack:
    name: str
    tree: Path
    url: str = ""
    key: str = ""
    processes: list[subprocess.Popen] = field(default_factory=list)


def start(stack: Stack, work: Path, model_dir: Path) -> None:
    """The tree's engine, gateway and usage worker on its own SQLite files under `work`, migrated and seeded."""
    work.mkdir(parents=True)
    tree = stack.tree
    env = {
        **os.environ, "DJANGO_SETTINGS_MODULE": "quilt.settings.dev", "DEBUG": "false", "ALLOWED_HOSTS": "*",
        "DATABASE_URL": f"sqlite:///{work / 'quilt.sqlite3'}", "REDIS_URL": "",
        "CELERY_BROKER_URL": f"sqla+sqlite:///{work / 'broker.sqlite3'}", "MEDIA_ROOT": str(work / "media"),
        "QUILT_ENGINE_TOKEN": TOKEN, "PYTHONPATH": f"{tree}:{tree / 'platform'}", "LOG_LEVEL": "WARNING",
    }  # fmt: skip
    python = sys.executable
    subprocess.run([python, "manage.py", "migrate", "--verbosity", "0"], cwd=tree, env=env, check=True)
    engine_port, gateway_port = free_port(), free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    log = open(work / "processes.log", "w")  # noqa: SIM115 - kept open while they run
    commands = [
        [python, "-m", "engine", "--model", str(model_dir), "--port", str(engine_port), "--served-model-name", MODEL,
         "--adapter-store", str(work / "media" / "adapters"), "--broker-url", env["CELERY_BROKER_URL"],
         "--usage-spool", str(work / "spool.jsonl"), "--log-level", "warning"],
        [python, "-m", "uvicorn", "gateway.asgi:application", "--app-dir", str(tree / "platform"),
         *gateway_server_flags(tree), "--port", str(gateway_port), "--no-access-log",
         "--lifespan", "off", "--timeout-keep-alive", "75", "--log-level", "warning"],
        [python, "-m", "celery", "--workdir", str(tree / "platform"), "-A", "quilt", "worker", "--pool", "solo",
         "--loglevel", "WARNING"],
    ]  # fmt: skip
    stack.processes = [subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
                       for command in commands]  # fmt: skip
    wait_http(f"{engine_url}/v1/health", (200,), stack.processes[0])
    stack.url = f"http://127.0.0.1:{gateway_port}"
    wait_http(f"{stack.url}/v1/models", (401,), stack.processes[1])
    seed = SEED.format(model=MODEL, model_dir=str(model_dir), engine_url=engine_url)
    out = subprocess.run([python, "manage.py", "shell", "-c", seed], cwd=tree, env=env, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    stack.key = next(line[4:] for line in out.splitlines() if line.startswith("KEY="))
    time.sleep(1.5)  # the gateway's engine list refreshes once a second


@dataclass
class Stream:
    gap: float  # [DONE] - the last text chunk, seconds
    intervals: list[float]  # between its text chunks


async def one_stream(client: httpx.AsyncClient, stack: Stack, prompt: str, max_tokens: int) -> Stream | str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    texts: list[float] = []
    done = None
    async with client.stream("POST", f"{stack.url}/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {stack.key}"}) as response:  # fmt: skip
        if response.status_code != 200:
            return f"{response.status_code} {(await response.aread())[:200]!r}"
        async for line in response.aiter_lines():
            now = time.perf_counter()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = now
                break  # as guidellm does: the request is done at [DONE]
            choices = json.loads(line[6:]).get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                texts.append(now)
    if done is None or not texts:
        return "no [DONE] or no text"
    return Stream(gap=done - texts[-1], intervals=[b - a for a, b in zip(texts, texts[1:], strict=False)])


async def run_level(stack: Stack, streams: int, requests: int, max_tokens: int) -> tuple[list[Stream], list[str]]:
    done: list[Stream] = []
    errors: list[str] = []
    left = list(range(requests))
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def worker() -> None:
            while left:
                number = left.pop()
                result = await one_stream(client, stack, PROMPTS[number % len(PROMPTS)], max_tokens)
                (done if isinstance(result, Stream) else errors).append(result)

        await asyncio.gather(*(worker() for _ in range(streams)))
    return done, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of the baseline (a git worktree)")
    parser.add_argument("--levels", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--requests", type=int, default=64, help="per tree, level and round (at least the level)")
    parser.add_argument("--rounds", type=int, default=2, help="turns each tree takes at each level")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", type=Path, default=REPO / "var" / "demo-model")
    parser.add_argument("--keep", action="store_true", help="keep the stacks' folders (logs, databases)")
    parser.add_argument("--guidellm", action="store_true", help="also load this tree with guidellm at each level")
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        raise SystemExit(f"no model at {args.model}: build it with `.venv/bin/python -m engine.demo --out var/demo-model`")
    with work_folder("quilt-stream-end-", keep=args.keep) as work:
        stacks = [Stack("baseline", args.baseline.resolve()), Stack("this", REPO)]
        try:
            for stack in stacks:
                start(stack, work / stack.name, args.model.resolve())
            measure(stacks, args)
            if args.guidellm:
                measure_guidellm(stacks[1], args, work, args.model.resolve())
        finally:
            for stack in stacks:
                for process in stack.processes:
                    process.terminate()
                for process in stack.processes:
                    try:
                        process.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        process.kill()
        if args.keep:
            print(f"kept {work}")


def measure(stacks: list[Stack], args: argparse.Namespace) -> None:
    """Each level: a warm-up, then the trees in turn, --rounds times; one row per tree."""
    print(f"{os.cpu_count()} CPUs; trees: " + ", ".join(f"{s.name} {s.tree}" for s in stacks))
    print(f"{'tree':>9} {'streams':>7} {'requests':>8} {'errors':>6} {'p50 gap ms':>10} {'p90 gap ms':>10} "
          f"{'median ITL ms':>13} {'gap/ITL':>7}")  # fmt: skip
    for streams in args.levels:
        results: dict[str, tuple[list[Stream], list[str]]] = {s.name: ([], []) for s in stacks}
        asyncio.run(run_level(stacks[1], streams, streams, args.max_tokens))  # warm-up, not counted
        for _ in range(args.rounds):
            for stack in stacks:
                done, errors = asyncio.run(run_level(stack, streams, max(args.requests, streams), args.max_tokens))
                results[stack.name][0].extend(done)
                results[stack.name][1].extend(errors)
        gaps = {}
        for stack in stacks:
            done, errors = results[stack.name]
            if not done:
                print(f"{stack.name:>9} {streams:>7} {0:>8} {len(errors):>6}  {errors[:1]}")
                continue
            gap = statistics.median(s.gap for s in done)
            p90 = statistics.quantiles([s.gap for s in done], n=10)[-1] if len(done) > 1 else gap
            itl = statistics.median(i for s in done for i in s.intervals)
            gaps[stack.name] = gap
            print(f"{stack.name:>9} {streams:>7} {len(done):>8} {len(errors):>6} {gap * 1000:>10.1f} "
                  f"{p90 * 1000:>10.1f} {itl * 1000:>13.1f} {gap / itl:>7.2f}")  # fmt: skip
            if errors:
                print(f"{'':>9} first error: {errors[0]}")
        if len(gaps) == 2 and gaps["baseline"] > 0:
            print(f"{'':>9} {streams:>7} p50 gap this/baseline: {gaps['this'] / gaps['baseline']:.2f}")


def measure_guidellm(stack: Stack, args: argparse.Namespace, work: Path, model_dir: Path) -> None:
    """guidellm against `stack` at each level (synchronous at one stream, else concurrent), offline, with the demo
    model's tokenizer; one row per level from its JSON report."""
    print(f"guidellm against {stack.name} (ignore_eos; prompt 16 tokens, output {args.max_tokens})")
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    for streams in args.levels:
        report = work / f"guidellm-{streams}.json"
        profile = "kind=synchronous" if streams == 1 else f"kind=concurrent,streams={streams}"
        command = [
            sys.executable, "-m", "guidellm", "run",
            "--backend", f"kind=openai_http,target={stack.url},model={MODEL},api_key={stack.key},timeout=120",
            "--profile", profile, "--constraint", f"kind=max_requests,count={max(args.requests, streams)}",
            "--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens={args.max_tokens}",
            "--tokenizer", f"kind=huggingface_auto,model={model_dir}", "--output", f"kind=json,path={report}",
            "--disable-console",
        ]  # fmt: skip
        run = subprocess.run(command, env=os.environ | offline, cwd=work, capture_output=True, text=True)
        if run.returncode != 0:
            print(f"{'guidellm':>9} {streams:>7} failed: {(run.stdout + run.stderr)[-400:]}")
            continue
        (benchmark,) = json.loads(report.read_text())["benchmarks"]
        totals = benchmark["metrics"]["request_totals"]
        timings = [request["info"]["timings"] for request in benchmark["requests"]["successful"]]
        gaps = [t["last_request_iteration"] - t["last_token_iteration"] for t in timings]
        gap = statistics.median(gaps)
        itl = benchmark["metrics"]["inter_token_latency_ms"]["successful"]["median"] / 1000.0
        print(f"{'guidellm':>9} {streams:>7} {totals['successful']:>8} {totals['errored']:>6} {gap * 1000:>10.1f} "
              f"{statistics.quantiles(gaps, n=10)[-1] * 1000 if len(gaps) > 1 else gap * 1000:>10.1f} "
              f"{itl * 1000:>13.1f} {gap / itl:>7.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
