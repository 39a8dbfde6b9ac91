"""The cold cliff: TTFT when N adapters share a device pool that holds N/2, against the same load with all resident.

    .venv/bin/python -m benchmarks.cold_cliff [--adapters 8] [--layers 1] [--requests 30] [--rate 0.3]
        [--popularity uniform zipf] [--runs 3] [--device cpu] [--json out.json]

Adapters of real size: rank 16 on all seven projections of a Llama-3-8B-shape layer (hidden 4096, intermediate
14336, 32 heads, 8 KV heads), `--layers` layers (1 by default, so that a shared 2-core CPU serves it: 32 layers would make
each adapter 84 MB in bf16), random weights, written in Quilt's stored format. Requests arrive as a Poisson process at
`--rate` per second, each on an adapter drawn uniformly or by Zipf (exponent `--zipf-s`), with a `--prompt`-token
prompt and `--max-tokens` output tokens, driven through LLMEngine.step in this process.

Two engines serve the same trace (same arrivals, adapters and prompts):
- resident: the pool has room for all N adapters, and every adapter is placed on the device before the clock
  starts;
- oversubscribed: the pool's adapter share holds N/2 adapters and the host tier N/2, so adapters leave and come
  back: from disk (read around the page cache: `adapter_read_uncached`, posix_fadvise DONTNEED before and after
  each read, the files fsynced when written, so every read is a disk read) into host memory, then into pages.
Each engine first serves one request per adapter (not timed). Printed per popularity and run: TTFT p50 and p99 of
both, their ratios (oversubscribed / resident), and the adapter loads of the oversubscribed run; then the
ratios' spread over the runs against the goals (CPU: <= 1.3x p50 and <= 2x p99 uniform, <= 1.1x p50 Zipf).
"""

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import llama_shape
from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

GOALS = {"uniform": {"p50": 1.3, "p99": 2.0}, "zipf": {"p50": 1.1}}


def eight_b_layers(layers: int, *, tiny: bool = False) -> llama_shape.Shape:
    """`layers` layers of Llama-3-8B's shape (a small vocabulary: the adapters do not touch it); `tiny`: a toy shape
    that only checks the wiring (gpu_suite.sh --dry-run)."""
    if tiny:
        return llama_shape.Shape("tiny", hidden=128, intermediate=256, layers=layers, heads=4, kv_heads=2, vocab=1024,
                                 max_position=2048)
    return llama_shape.Shape("llama-3-8b-layers", hidden=4096, intermediate=14336, layers=layers, heads=32,
                             kv_heads=8, vocab=1024, max_position=2048)


def write_fsynced(root: Path, shape: llama_shape.Shape, count: int, *, rank: int, dtype: torch.dtype
                  ) -> list[tuple[str, str]]:
    """(folder, digest) of `count` adapters, their files on disk (fsynced: clean pages the kernel can drop)."""
    written, _ = llama_shape.write_adapters(root, shape, list(range(count)), rank=rank, dtype=dtype, device="cpu")
    for folder, _ in written.values():
        for file in Path(folder).iterdir():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return [written[i] for i in range(count)]


def trace(args, popularity: str, seed: int) -> list[tuple[float, int, list[int]]]:
    """(arrival second, adapter index, prompt) of each request: Poisson arrivals, uniform or Zipf adapters."""
    rng = random.Random(seed)
    weights = ([1.0] * args.adapters if popularity == "uniform"
               else [1.0 / (i + 1) ** args.zipf_s for i in range(args.adapters)])
    order = list(range(args.adapters))
    rng.shuffle(order)  # which adapter is the most popular differs from run to run
    out, now = [], 0.0
    for _ in range(args.requests):
        now += rng.expovariate(args.rate)
        adapter = order[rng.choices(range(args.adapters), weights)[0]]
        out.append((now, adapter, [rng.randrange(3, 1024) for _ in range(args.prompt)]))
    return out


def build_engine(args, base: Path, adapters: list[tuple[str, str]], *, resident: bool) -> LLMEngine:
    held = args.adapters if resident else args.adapters // 2
    itemsize = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    probe = llama_shape.adapter_bytes(eight_b_layers(args.layers, tiny=args.tiny), 16, itemsize)
    config = EngineConfig(
        model=str(base), device=args.device, dtype=args.dtype, block_size=16, num_kv_blocks=args.kv_blocks,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.batched_tokens, max_adapter_rank=16,
        pool_adapters_at_max_rank=held, host_adapter_cache_bytes=(10 * args.adapters if resident else held) * probe,
        adapter_read_uncached=True, enable_prefix_caching=False)
    engine = LLMEngine(config)
    for folder, digest in adapters:
        engine.register_adapter(digest, folder)
    return engine


def serve(engine: LLMEngine, digests: list[str], requests: list[tuple[float, int, list[int]]], *, tag: str,
          max_tokens: int) -> list[float]:
    """TTFT in seconds of each request, in trace order, serving the trace in real time."""
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first: dict[str, float] = {}
    arrived: dict[str, float] = {}
    start, i = time.monotonic(), 0
    while i < len(requests) or engine.has_unfinished():
        now = time.monotonic() - start
        while i < len(requests) and requests[i][0] <= now:
            request_id = f"{tag}-{i}"
            engine.add_request(request_id, requests[i][2], sampling, adapter=digests[requests[i][1]])
            arrived[request_id] = start + requests[i][0]
            i += 1
        steps = engine.num_steps
        for out in engine.step():
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = time.monotonic()
        if engine.num_steps == steps:
            wait = requests[i][0] - (time.monotonic() - start) if i < len(requests) else 0.001
            time.sleep(min(max(wait, 0.0), 0.002) or 0.0005)
    return [first[f"{tag}-{k}"] - arrived[f"{tag}-{k}"] for k in range(len(requests))]


def warm(engine: LLMEngine, digests: list[str], *, resident: bool) -> None:
    """One request per adapter, untimed; with `resident`, every adapter then placed on the device."""
    prompts = [(0.0, k, [5, 6, 7]) for k in range(len(digests))]
    serve(engine, digests, prompts, tag="warm", max_tokens=1)
    if resident:
        for digest in digests:
            while engine.adapter_pool.tier(digest) == "loading":
                time.sleep(0.01)
            engine.prefetch_adapter(digest, "device")
        assert all(engine.adapter_pool.tier(d) == "device" for d in digests), "the resident pool holds them all"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def one_run(args, base: Path, adapters: list[tuple[str, str]], popularity: str, seed: int) -> dict:
    digests = [digest for _, digest in adapters]
    requests = trace(args, popularity, seed)
    result = {"popularity": popularity, "seed": seed}
    for mode in ("resident", "oversubscribed"):
        engine = build_engine(args, base, adapters, resident=mode == "resident")
        warm(engine, digests, resident=mode == "resident")
        before = dict(engine.adapter_pool.num_loads)
        ttft = serve(engine, digests, requests, tag=mode, max_tokens=args.max_tokens)
        loads = {tier: engine.adapter_pool.num_loads[tier] - before[tier] for tier in before}
        result[mode] = {"p50_ms": 1000 * percentile(ttft, 50), "p99_ms": 1000 * percentile(ttft, 99),
                        "loads": loads}
        engine.shutdown()
    result["ratio_p50"] = result["oversubscribed"]["p50_ms"] / result["resident"]["p50_ms"]
    result["ratio_p99"] = result["oversubscribed"]["p99_ms"] / result["resident"]["p99_ms"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--rate", type=float, default=0.3, help="requests per second (Poisson)")
    parser.add_argument("--prompt", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--zipf-s", type=float, default=1.1)
    parser.add_argument("--popularity", nargs="+", default=["uniform", "zipf"], choices=["uniform", "zipf"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-blocks", type=int, default=24, help="the pool's KV pages: less than one adapter's "
                        "pages, so that the pool holds N/2 adapters and no more")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--batched-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--tiny", action="store_true", help="a toy shape: checks the wiring, measures nothing")
    parser.add_argument("--work", type=Path, help="where the checkpoint and adapters go (default: a temporary folder)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shape, dtype = eight_b_layers(args.layers, tiny=args.tiny), getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        root = Path(tmp)
        llama_shape.write_checkpoint(root / "base", shape, dtype=dtype, device="cpu")
        adapters = write_fsynced(root, shape, args.adapters, rank=16, dtype=dtype)
        size = (Path(adapters[0][0]) / "adapter_model.safetensors").stat().st_size
        print(f"{args.adapters} adapters of {size / 1e6:.1f} MB (rank 16, 7 projections, {args.layers} layers of "
              f"{shape.name}; {size / args.layers * 32 / 1e6:.0f} MB at 32 layers), pool holds {args.adapters // 2}; "
              f"{args.requests} requests at {args.rate}/s, prompt {args.prompt}, {args.max_tokens} tokens; reads "
              f"around the page cache (posix_fadvise DONTNEED); device {args.device}, {args.dtype}, "
              f"{torch.get_num_threads()} threads", flush=True)
        results = []
        for run in range(args.runs):
            for popularity in args.popularity:
                r = one_run(args, root / "base", adapters, popularity, seed=run)
                results.append(r)
                print(f"run {run} {popularity:7s} TTFT p50 {r['resident']['p50_ms']:7.1f} -> "
                      f"{r['oversubscribed']['p50_ms']:7.1f} ms ({r['ratio_p50']:.2f}x), p99 "
                      f"{r['resident']['p99_ms']:7.1f} -> {r['oversubscribed']['p99_ms']:7.1f} ms "
                      f"({r['ratio_p99']:.2f}x); loads {r['oversubscribed']['loads']}", flush=True)
    for popularity in args.popularity:
        mine = [r for r in results if r["popularity"] == popularity]
        for q in ("p50", "p99"):
            ratios = [r[f"ratio_{q}"] for r in mine]
            goal = GOALS[popularity].get(q)
            verdict = "" if goal is None else f"; goal <= {goal}x: {'met' if max(ratios) <= goal else 'NOT met'}"
            print(f"{popularity:7s} {q}: {statistics.median(ratios):.2f}x median, {min(ratios):.2f}-"
                  f"{max(ratios):.2f}x over {len(ratios)} runs{verdict}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": results},
                                        indent=1))


if __name__ == "__main__":
    main()
