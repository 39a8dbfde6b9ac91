"""The KV host tier: prefix hit rate and TTFT with and without it, and against an unbounded device cache.

    .venv/bin/python -m benchmarks.host_tier [--prompts 8] [--system-tokens 256] [--requests 240]
        [--concurrency 4] [--zipf 1.1] [--rounds 2] [--threads 1] [--device cpu] [--quick]

A random Llama (hidden 256, 4 layers, fp32; built in a temporary folder) serves requests made of one of 4N
distinct shared system prompts (N = --prompts) followed by a short user part of its own, the system prompt
drawn by a power law (Zipf, exponent --zipf: a few prompts hot, a long tail revisited now and then), greedy,
4 output tokens, --concurrency requests in flight. Three engines run the same requests in the same process:

    device      pages for N system prompts (plus room for the requests in flight): evicted prefixes are gone
    host tier   the same pages, and --kv-host-cache-gb holding all 4N system prompts
    unbounded   pages for all 4N system prompts: no prefix is ever evicted (the ceiling)

Printed per engine: prefix hit rate (cached prompt tokens / prompt tokens), its fraction of the unbounded
engine's (goal for the host tier: >= 0.9), host-tier hit and missed blocks, TTFT p50 and p99 (the engine's
own, from arrival to first token) and their ratio to the device-only engine's, wall time. Each round runs the
three on fresh engines, the order rotated; figures are medians over rounds.
"""

import argparse
import random
import statistics
import tempfile
import time
from collections import deque
from pathlib import Path

import torch

from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.paged_memory import PagedMemory

BLOCK = 16
VOCAB = 512
TAIL = 16  # a request's own tokens after its system prompt
SAMPLING = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BLOCK_BYTES = PagedMemory.bytes_per_page(num_layers=4, block_size=BLOCK, kv_heads=4, head_dim=32, itemsize=4)


def random_model(directory: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=2048)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def workload(args) -> list[list[int]]:
    rng = random.Random(0)
    systems = [[rng.randrange(3, VOCAB) for _ in range(args.system_tokens)] for _ in range(4 * args.prompts)]
    weights = [1 / (rank + 1) ** args.zipf for rank in range(len(systems))]
    picks = rng.choices(range(len(systems)), weights=weights, k=args.requests)
    return [systems[i] + [rng.randrange(3, VOCAB) for _ in range(TAIL)] for i in picks]


def engine_for(model: Path, args, name: str) -> LLMEngine:
    per_prompt = args.system_tokens // BLOCK
    in_flight = args.concurrency * -(-(args.system_tokens + TAIL + SAMPLING.max_tokens) // BLOCK)
    prompts = 4 * args.prompts if name == "unbounded" else args.prompts
    host_bytes = 4 * args.prompts * per_prompt * BLOCK_BYTES if name == "host tier" else 0
    config = EngineConfig(model=str(model), device=args.device, block_size=BLOCK,
                          num_kv_blocks=prompts * per_prompt + in_flight, pool_adapter_bytes=0,
                          max_num_batched_tokens=1024, kv_host_cache_gb=host_bytes / 2**30)
    return LLMEngine(config)


def run(engine: LLMEngine, prompts: list[list[int]], concurrency: int) -> dict:
    pending = deque(enumerate(prompts))
    in_flight, ttft, cached, total = set(), [], 0, 0
    start = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            i, prompt = pending.popleft()
            engine.add_request(f"r{i}", prompt, SAMPLING)
            in_flight.add(f"r{i}")
        steps = engine.num_steps
        for output in engine.step():
            if output.finished:
                in_flight.discard(output.request_id)
                ttft.append(output.usage.ttft_ms)
                cached += output.usage.cached_tokens
                total += output.usage.prompt_tokens
        if engine.num_steps == steps:
            time.sleep(0.0002)  # every waiting sequence is loading its blocks
    wall = time.perf_counter() - start
    ttft.sort()
    tiers = engine.kv_tiers_state()
    engine.shutdown()
    return {"hit_rate": cached / total, "ttft_p50": ttft[len(ttft) // 2],
            "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], "wall_s": wall,
            "host": tiers.get("host")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="N: the device pages hold N system prompts")
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 prompts, 24 requests, one round")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.requests, args.rounds, args.system_tokens = 2, 24, 1, 64
    if args.system_tokens % BLOCK:
        parser.error(f"--system-tokens must be a multiple of the block size ({BLOCK})")
    torch.set_num_threads(args.threads)
    names = ["device", "host tier", "unbounded"]
    prompts = workload(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = random_model(Path(tmp) / "model")
        run(engine_for(model, args, "device"), prompts[:8], args.concurrency)  # warm-up
        results = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % 3 :] + names[: r % 3]:
                results[name].append(run(engine_for(model, args, name), prompts, args.concurrency))
    median = {name: {key: statistics.median(x[key] for x in runs) for key in ("hit_rate", "ttft_p50", "ttft_p99",
                                                                            "wall_s")}
              for name, runs in results.items()}
    base, ceiling = median["device"], median["unbounded"]["hit_rate"]
    print(f"{4 * args.prompts} system prompts of {args.system_tokens} tokens, device pages for {args.prompts}; "
          f"{args.requests} requests, Zipf {args.zipf}, {args.concurrency} in flight, {args.rounds} round(s), "
          f"{args.threads} torch thread(s), {args.device}")
    print(f"{'engine':<10} {'hit rate':>8} {'of unbounded':>12} {'TTFT p50 ms':>11} {'p99 ms':>8} "
          f"{'p50 vs device':>13} {'p99 vs device':>13} {'wall s':>7}  host tier")
    for name in names:
        m = median[name]
        host = results[name][-1]["host"]
        host_text = f"hits {host['hits']} misses {host['misses']} saved {host['saved']}" if host else "-"
        print(f"{name:<10} {m['hit_rate']:>8.3f} {m['hit_rate'] / ceiling:>12.3f} {m['ttft_p50']:>11.1f} "
              f"{m['ttft_p99']:>8.1f} {base['ttft_p50'] / m['ttft_p50']:>12.2f}x {base['ttft_p99'] / m['ttft_p99']:>12.2f}x "
              f"{m['wall_s']:>7.1f}  {host_text}")


if __name__ == "__main__":
    main()
