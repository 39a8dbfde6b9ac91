"""Disaggregated prefill/decode on CPU: do long prompts stop stalling everyone's token stream?

    python benchmarks/disaggregation.py [--duration 40] [--streams 3] [--long-every 2.5] [--quick]

Builds a tiny random Llama in code whose context holds 2k-token prompts (the demo model's holds 256), then runs the
same seeded load against two setups, one after the other:

    colocated          one engine (--role both) pinned to cores 0,1 (taskset), 2 torch threads
    colocated-chunked  the same with chunked prefill (--long-prefill-token-threshold 256: a long prompt takes
                       256 tokens a step, interleaved with the decodes), the usual colocated defence
    disaggregated      a prefill engine on core 0 and a decode engine on core 1 (taskset), 1 torch thread each

The load: `--streams` clients stream short-prompt requests back to back (32 prompt tokens, 32 new tokens), while
long prompts (1,024-2,048 random tokens, 8 new tokens) arrive every `--long-every` seconds. Colocated, everything
goes to the one engine. Disaggregated, short prompts go straight to the decode engine (llm-d's rule: a short
uncached prompt skips the prefill hop) and long ones take the prefill hop (`kv_transfer` mode "prefill", the lease)
then the decode hop with the lease, as the gateway sends them (platform/gateway/disaggregation.py; the gateway
itself is left out: it adds the same to both setups, benchmarks/gateway_overhead.py measures it).

Reported per setup: TTFT p50/p99 of short and long requests (a long one's includes its prefill hop), inter-token
latency p50/p99 (and p99.9, max) of the short streams (the gaps between their token events: what prefill pressure
stalls), output tokens per second over the run; then disaggregated ÷ each colocated setup. The issue's goal: short-stream ITL p99 at most 0.5,
throughput at least 0.8. Prompts are random tokens, so no prefix is ever cached. Nothing is asserted.
"""

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-disaggregation-token"
VOCAB = 1024
CONTEXT = 2304
SHORT_PROMPT, SHORT_NEW = 32, 32
LONG_PROMPT, LONG_NEW = (1024, 2048), 8
HIDDEN = 128
CHUNK = 256  # the chunked colocated setup's --long-prefill-token-threshold


def build_model(directory: Path) -> Path:
    """A random Llama whose 2k-token prefill costs many decode steps (4 layers, hidden HIDDEN)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=HIDDEN * 8 // 3, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    return directory


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_engine(model: Path, *, role: str, cores: str, threads: int, work: Path, extra: list[str]):
    port = free_port()
    env = {**os.environ, "QUILT_ENGINE_TOKEN": TOKEN, "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": str(REPO)}  # fmt: skip
    command = ["taskset", "-c", cores, sys.executable, "-m", "engine", "--model", str(model), "--port", str(port),
               "--role", role, "--usage-spool", str(work / f"spool-{role}-{port}.jsonl"), "--log-level", "warning",
               "--max-model-len", str(CONTEXT), *extra]  # fmt: skip
    log = open(work / f"engine-{role}-{port}.log", "w")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the {role} engine exited with {process.returncode}: see {log.name}")
        try:
            if httpx.get(f"{url}/v1/health", timeout=1, headers=HEADERS).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"the {role} engine did not answer in 300 s")


HEADERS = {"Authorization": f"Bearer {TOKEN}"}
SETUPS = ("colocated", "colocated-chunked", "disaggregated")


@dataclass
class Figures:
    short_ttft: list[float] = field(default_factory=list)
    long_ttft: list[float] = field(default_factory=list)
    prefill_hop: list[float] = field(default_factory=list)  # of long_ttft, the prefill hop's part
    short_itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    failed: list[str] = field(default_factory=list)
    transfers: dict[str, int] = field(default_factory=dict)  # pulled / recomputed


def body(request_id: str, tokens: list[int], new: int, *, stream: bool) -> dict:
    return {"request_id": request_id, "tenant": "bench", "prompt_token_ids": tokens, "stream": stream,
            "sampling": {"max_tokens": new, "temperature": 0.0, "ignore_eos": True}}  # fmt: skip


async def stream(client: httpx.AsyncClient, url: str, payload: dict, figures: Figures, *, started: float,
                 short: bool) -> None:
    last = None
    async with client.stream("POST", f"{url}/v1/generate", json=payload, headers=HEADERS) as response:
        if response.status_code != 200:
            figures.failed.append(f"{response.status_code} {(await response.aread())[:200]!r}")
            return
        async for line in response.aiter_lines():
            if not line.strip():
                continue
            event = json.loads(line)
            now = time.monotonic()
            tokens = len(event.get("token_ids") or [])
            if event.get("type") == "delta" and tokens:
                if last is None:
                    (figures.short_ttft if short else figures.long_ttft).append(now - started)
                elif short:
                    figures.short_itl.append(now - last)
                last = now
                figures.output_tokens += tokens
            elif event.get("type") == "final":
                transfer = (event.get("usage") or {}).get("kv_transfer")
                if transfer is not None:
                    outcome = "recomputed" if transfer.get("recomputed") else "pulled"
                    figures.transfers[outcome] = figures.transfers.get(outcome, 0) + 1
                if event.get("finish_reason") == "error":
                    figures.failed.append(str(event.get("error")))


async def long_request(client, setup: dict, request_id: str, tokens: list[int], figures: Figures) -> None:
    started = time.monotonic()
    payload = body(request_id, tokens, LONG_NEW, stream=True)
    if "prefill" in setup:  # the prefill hop, then the decode hop with the lease (KV_CONTRACT.md)
        hop = body(request_id, tokens, LONG_NEW, stream=False) | {"kv_transfer": {"mode": "prefill"}}
        answer = await client.post(f"{setup['prefill']}/v1/generate", json=hop, headers=HEADERS)
        figures.prefill_hop.append(time.monotonic() - started)
        if answer.status_code == 200 and "kv_lease" in answer.json():
            payload["kv_transfer"] = {"mode": "decode", "lease": answer.json()["kv_lease"]}
        else:
            figures.failed.append(f"prefill hop {answer.status_code} {answer.text[:200]}")
    await stream(client, setup["serve"], payload, figures, started=started, short=False)


async def run_load(setup: dict, *, duration: float, streams: int, long_every: float, seed: int) -> tuple[Figures, float]:
    figures = Figures()
    rng = random.Random(seed)
    deadline = time.monotonic() + duration

    async def short_client(k: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            tokens = [rng.randrange(3, VOCAB) for _ in range(SHORT_PROMPT)]
            await stream(client, setup["serve"], body(f"s{k}-{n}", tokens, SHORT_NEW, stream=True), figures,
                         started=time.monotonic(), short=True)  # fmt: skip
            n += 1

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        began = time.monotonic()
        tasks = [asyncio.create_task(short_client(k)) for k in range(streams)]
        await asyncio.sleep(long_every / 2)
        n = 0
        while time.monotonic() < deadline:
            tokens = [rng.randrange(3, VOCAB) for _ in range(rng.randint(*LONG_PROMPT))]
            tasks.append(asyncio.create_task(long_request(client, setup, f"l{n}", tokens, figures)))
            n += 1
            await asyncio.sleep(long_every)
        await asyncio.gather(*tasks)
        return figures, time.monotonic() - began


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(name: str, figures: Figures, seconds: float) -> dict:
    row = {"setup": name, "short requests": len(figures.short_ttft), "long requests": len(figures.long_ttft),
           "short TTFT p50/p99 ms": (percentile(figures.short_ttft, 0.5) * 1e3, percentile(figures.short_ttft, 0.99) * 1e3),
           "long TTFT p50/p99 ms": (percentile(figures.long_ttft, 0.5) * 1e3, percentile(figures.long_ttft, 0.99) * 1e3),
           "prefill hop p50/p99 ms": (percentile(figures.prefill_hop, 0.5) * 1e3, percentile(figures.prefill_hop, 0.99) * 1e3),
           "short ITL p50/p99 ms": (percentile(figures.short_itl, 0.5) * 1e3, percentile(figures.short_itl, 0.99) * 1e3),
           "short ITL p99.9/max ms": (percentile(figures.short_itl, 0.999) * 1e3, max(figures.short_itl or [0]) * 1e3),
           "output tok/s": figures.output_tokens / seconds, "failed": len(figures.failed),
           "transfers": figures.transfers}  # fmt: skip
    print(f"\n{name} ({seconds:.1f} s):")
    for key, value in row.items():
        if isinstance(value, tuple):
            value = f"{value[0]:.1f} / {value[1]:.1f}"
        elif isinstance(value, float):
            value = f"{value:.1f}"
        print(f"  {key:24} {value}")
    for failure in figures.failed[:3]:
        print(f"  failure: {failure}")
    return row


def warm(setup: dict) -> None:
    """One short and one long request, outside the measurement (first-call costs, allocator growth)."""
    figures = Figures()

    async def go() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            await stream(client, setup["serve"], body("warm-s", list(range(3, 3 + SHORT_PROMPT)), 4, stream=True),
                         figures, started=time.monotonic(), short=True)  # fmt: skip
            await long_request(client, setup, "warm-l", [5 + i % 900 for i in range(LONG_PROMPT[1])], figures)

    asyncio.run(go())
    if figures.failed:
        raise SystemExit(f"warm-up failed: {figures.failed[:2]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of load per setup")
    parser.add_argument("--streams", type=int, default=3, help="short-prompt clients streaming back to back")
    parser.add_argument("--long-every", type=float, default=2.5, help="seconds between long prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-args", default="", help="more `python -m engine` flags for every engine")
    parser.add_argument("--quick", action="store_true", help="10 s per setup (a smoke run, not figures)")
    parser.add_argument("--only", choices=SETUPS, help="run one setup")
    args = parser.parse_args()
    duration = 10.0 if args.quick else args.duration
    extra = args.engine_args.split()
    with tempfile.TemporaryDirectory(prefix="disaggregation-") as tmp:
        work = Path(tmp)
        model = build_model(work / "model")
        rows = {}
        for name in SETUPS:
            if args.only and name != args.only:
                continue
            processes = []
            try:
                if name.startswith("colocated"):
                    chunked = ["--long-prefill-token-threshold", str(CHUNK)] if name == "colocated-chunked" else []
                    process, url = start_engine(model, role="both", cores="0,1", threads=2, work=work,
                                                extra=extra + chunked)  # fmt: skip
                    processes, setup = [process], {"serve": url}
                else:
                    # the prefill engine chunks its prompts too: on CPU a 256-token chunk over the cached prefix is
                    # faster than a whole 2k-token prompt in one step (and it stalls no decode here)
                    prefill, prefill_url = start_engine(model, role="prefill", cores="0", threads=1, work=work,
                                                        extra=[*extra, "--long-prefill-token-threshold", str(CHUNK)])
                    decode, decode_url = start_engine(model, role="decode", cores="1", threads=1, work=work,
                                                      extra=extra)  # fmt: skip
                    processes, setup = [prefill, decode], {"serve": decode_url, "prefill": prefill_url}
                warm(setup)
                figures, seconds = asyncio.run(run_load(setup, duration=duration, streams=args.streams,
                                                        long_every=args.long_every, seed=args.seed))  # fmt: skip
                rows[name] = summary(name, figures, seconds)
            finally:
                for process in processes:
                    process.terminate()
                    process.wait(timeout=30)
        split = rows.get("disaggregated")
        for name in ("colocated", "colocated-chunked"):
            if split is None or name not in rows:
                continue
            base = rows[name]
            itl = split["short ITL p50/p99 ms"][1] / base["short ITL p50/p99 ms"][1]
            tail = split["short ITL p99.9/max ms"][0] / base["short ITL p99.9/max ms"][0]
            ttft = split["short TTFT p50/p99 ms"][1] / base["short TTFT p50/p99 ms"][1]
            long_ttft = split["long TTFT p50/p99 ms"][0] / base["long TTFT p50/p99 ms"][0]
            throughput = split["output tok/s"] / base["output tok/s"]
            print(f"\ndisaggregated ÷ {name}: short ITL p99 {itl:.2f} (goal <= 0.5), p99.9 {tail:.2f}; short TTFT p99 "
                  f"{ttft:.2f}; long TTFT p50 {long_ttft:.2f}; throughput {throughput:.2f} (goal >= 0.8)")
        print(f"\nmachine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
