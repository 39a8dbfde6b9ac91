"""Adapter cold start on this machine: disk -> host-ready for a Llama-3-8B-shaped adapter, and
disk -> first token / host -> first token through an engine on a small model.

    python benchmarks/cold_start.py                    # CPU: the 8B adapter's load, a small model's TTFT
    python benchmarks/cold_start.py --device cuda      # the same on a GPU (the GPU trace has its own: trace_cold.py)

load  one rank-16 bf16 adapter on all seven projections of Llama-3-8B's 32 layers (84 MB), read from its
      canonical folder and laid out for the pages (AdapterPlan, pinned on CUDA), page cache dropped before each
      read: "known digest" is how the engine loads now (the digest was computed once, when the adapter became
      known); "hashed" recomputes it on the load, as every load did before; their ratio, side by side.
ttft  a small Llama (--hidden, 4 layers) with a rank-16 adapter: the first token of a request whose adapter is
      only on disk (registered by digest, page cache dropped), only in host memory, or already on the device;
      cold minus warm is what the adapter's arrival costs.
Every figure is the median of --runs runs (at least 3) with the min-max spread; on CPU they are CPU figures.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository before benchmarks/

import llama_shape  # noqa: E402
import trace_cold  # noqa: E402

import adapters  # noqa: E402
from engine import EngineConfig, SamplingParams  # noqa: E402
from engine.adapter_plan import AdapterPlan  # noqa: E402
from engine.adapter_pool import read_adapter  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.lora_modules import row_widths  # noqa: E402
from engine.page_budget import page_chunk  # noqa: E402


def spread(times: list[float]) -> str:
    return f"{statistics.median(times):8.1f} ms ({min(times):.1f}-{max(times):.1f})"


def load_times(root: Path, *, runs: int, pin: bool) -> dict:
    shape = llama_shape.LLAMA3_8B
    adapter = llama_shape.build_adapter(shape, rank=16, seed=1, dtype=torch.bfloat16, device="cpu")
    path, digest = adapter.save(root / "adapter-8b"), adapter.digest
    del adapter
    config = shape.hf_config()
    widths = row_widths(adapters.BaseShapes.from_config(config))
    chunk = page_chunk(block_size=16, kv_heads=shape.kv_heads, head_dim=shape.head_dim, dtype=torch.bfloat16,
                       kv_dtype=torch.bfloat16, widths=widths, tensor_parallel_size=1)
    times: dict[str, list[float]] = {"known digest": [], "hashed": []}
    cpu: dict[str, list[float]] = {"known digest": [], "hashed": []}
    for _ in range(runs):
        for kind in times:  # interleaved, so a drift of the machine's load falls on both
            trace_cold.drop_page_cache(path)
            start, start_cpu = time.perf_counter(), time.process_time()
            loaded = read_adapter(path, config, 64, digest=digest if kind == "known digest" else None)
            plan = AdapterPlan.build(loaded, num_layers=shape.layers, widths=widths, chunk=chunk, pin=pin)
            times[kind].append((time.perf_counter() - start) * 1e3)
            cpu[kind].append((time.process_time() - start_cpu) * 1e3)
            assert plan.digest == digest
            del loaded, plan
    return {"bytes": (path / "adapter_model.safetensors").stat().st_size, "ms": times, "cpu_ms": cpu}


def ttft_times(root: Path, *, device: str, hidden: int, runs: int) -> dict:
    shape = llama_shape.Shape("small", hidden=hidden, intermediate=hidden * 3, layers=4, heads=hidden // 64,
                              kv_heads=max(hidden // 256, 1), vocab=1024, max_position=1024)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    llama_shape.write_checkpoint(root / "model", shape, dtype=dtype, device="cpu")
    written, _ = llama_shape.write_adapters(root, shape, list(range(2 * runs)), rank=16, dtype=dtype, device="cpu")
    engine = LLMEngine(EngineConfig(model=str(root / "model"), device=device, dtype=str(dtype).removeprefix("torch."),
                                    num_kv_blocks=256))
    sampling = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompt = list(range(3, 3 + 64))
    counter = iter(range(10**6))

    def first_token(digest: str) -> float:
        request_id = f"r{next(counter)}"
        start = time.perf_counter()
        engine.add_request(request_id, prompt, sampling, adapter=digest)
        while engine.has_unfinished():
            engine.step()
        return (time.perf_counter() - start) * 1e3

    first_token(None)  # compile, allocate, warm the page pool
    times: dict[str, list[float]] = {"disk -> first token": [], "host -> first token": [], "warm": []}
    for i in range(runs):
        path, digest = written[2 * i]
        trace_cold.drop_page_cache(Path(path))
        engine.register_adapter(digest, path)
        times["disk -> first token"].append(first_token(digest))
        times["warm"].append(first_token(digest))
        path, digest = written[2 * i + 1]
        engine.add_adapter(path)
        times["host -> first token"].append(first_token(digest))
    engine.shutdown()
    return {"shape": shape.name, "hidden": hidden, "ms": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--skip-load", action="store_true", help="only the TTFT part (the 84 MB adapter is slow to draw)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.runs < 3:
        parser.error("--runs: at least 3")
    torch.manual_seed(0)
    result: dict = {"device": args.device, "runs": args.runs}
    with tempfile.TemporaryDirectory(prefix="quilt-cold-") as tmp:
        root = Path(tmp)
        result["filesystem"] = trace_cold.filesystem(root)
        print(f"## cold_start on {args.device} ({result['filesystem']}); median (min-max) of {args.runs} runs")
        if not args.skip_load:
            load = result["load"] = load_times(root, runs=args.runs, pin=args.device.startswith("cuda"))
            print(f"load: Llama-3-8B rank-16 adapter, {load['bytes'] / 1e6:.1f} MB, disk -> host-ready (read + layout)")
            for kind, times in load["ms"].items():
                print(f"  {kind:22} {spread(times)} wall, {spread(load['cpu_ms'][kind])} CPU (this process)")
            ratios = [h / k for h, k in zip(load["ms"]["hashed"], load["ms"]["known digest"], strict=True)]
            print(f"  hashed / known digest  {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
        ttft = result["ttft"] = ttft_times(root, device=args.device, hidden=args.hidden, runs=args.runs)
        print(f"ttft: Llama of hidden {args.hidden}, 4 layers, rank-16 adapters, a 64-token prompt, one token")
        for kind, times in ttft["ms"].items():
            print(f"  {kind:22} {spread(times)}")
        warm = statistics.median(ttft["ms"]["warm"])
        for kind in ("disk -> first token", "host -> first token"):
            print(f"  {kind} - warm: {statistics.median(ttft['ms'][kind]) - warm:+.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
