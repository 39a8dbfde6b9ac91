"""Many adapters at once on CPU: requests each on its own adapter vs no adapter vs one shared adapter.

    .venv/bin/python -m benchmarks.many_adapters [--adapters 1000] [--requests 256] [--rank 8]
        [--hidden 128 --layers 4] [--max-tokens 32] [--queued 1000] [--rounds 3] [--threads N] [--bookkeeping]

A small random Llama and N random rank-r adapters on all seven projections, written in Quilt's stored
format and registered with the engine (read lazily from disk, in the background, when first asked
for). The engine runs with its default configuration. Runs in this process, each on a fresh engine
with the same N adapters registered and the same prompts: every request on its own adapter, no
adapter, one adapter for all. "distinct" is serving throughput: the requests' adapters were read
from disk into the host cache beforehand (`prefetch_adapter(..., "host")`, timed and printed on its
own line); "distinct-cold" is the same run with every adapter read from disk while serving. Prints
output tokens per second of each (the median of `--rounds` alternated runs), the ratios, and the mean batch size (sequences per step) while
`--queued` requests, each on its own adapter, are waiting.
"""

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import adapters
from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

VOCAB = 1024
MODULES = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "o_proj": "o", "gate_proj": "up", "up_proj": "up",
           "down_proj": "down"}


def build_base(root: Path, hidden: int, layers: int) -> tuple[Path, LlamaConfig]:
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
        num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64),
        vocab_size=VOCAB, max_position_embeddings=1024, initializer_range=0.1,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "base")
    return root / "base", config


def build_adapters(root: Path, config: LlamaConfig, count: int, rank: int) -> dict[str, Path]:
    """digest -> folder of `count` random adapters in Quilt's stored format (also PEFT-readable)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (hidden // config.num_attention_heads)
    in_out = {"q": (hidden, hidden), "kv": (hidden, kv), "o": (hidden, hidden), "up": (hidden, inter),
              "down": (inter, hidden)}
    gen = torch.Generator().manual_seed(1)
    found = {}
    for i in range(count):
        tensors, ranks, alphas, scaling = {}, {}, {}, {}
        for layer in range(config.num_hidden_layers):
            for module, kind in MODULES.items():
                name, (width_in, width_out) = f"layers.{layer}.{module}", in_out[kind]
                tensors[f"{name}.lora_A"] = torch.randn(rank, width_in, generator=gen) / width_in**0.5
                tensors[f"{name}.lora_B"] = torch.randn(width_out, rank, generator=gen) * 0.02
                ranks[name], alphas[name], scaling[name] = rank, 16.0, 16.0 / rank
        adapter = adapters.LoadedAdapter.build(tensors=tensors, ranks=ranks, alphas=alphas, scaling=scaling,
                                               alpha=16.0, use_rslora=False, base_model_name_or_path=None)
        found[adapter.digest] = adapter.save(root / f"adapter{i}")
    return found


def new_engine(base: Path, adapter_dirs: dict[str, Path]) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(base)))
    for digest, path in adapter_dirs.items():
        engine.register_adapter(digest, path)
    return engine


def load_to_host(engine: LLMEngine, digests: list[str]) -> float:
    """Seconds to read `digests` from disk into the engine's host cache (its background loader)."""
    start = time.perf_counter()
    for digest in digests:
        engine.prefetch_adapter(digest, "host")
    while any(engine.adapter_pool.tier(d) not in ("host", "device") for d in digests):
        time.sleep(0.001)
    return time.perf_counter() - start


def run(engine: LLMEngine, prompts: list[list[int]], names: list[str | None], max_tokens: int,
        *, queued_stats: bool = False) -> tuple[float, int, float]:
    """Seconds to finish every request, output tokens, mean sequences per step while requests were waiting."""
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, (prompt, adapter) in enumerate(zip(prompts, names, strict=True)):
        engine.add_request(f"r{i}", prompt, sampling, adapter=adapter)
    tokens, sizes = 0, []
    while engine.has_unfinished():
        steps, waiting = engine.num_steps, len(engine.scheduler.waiting)
        tokens += sum(len(out.new_token_ids) for out in engine.step())
        if engine.num_steps == steps:
            time.sleep(0.0005)  # nothing could run yet: adapters are loading
        elif waiting:
            sizes.append(engine.last_step_seqs)
    elapsed = time.perf_counter() - start
    assert tokens == len(prompts) * max_tokens
    return elapsed, tokens, (sum(sizes) / len(sizes) if sizes else 0.0)


def bookkeeping(base: Path, config: LlamaConfig, rng: random.Random) -> None:
    """Host work that must not grow with registered adapters or the queue: per step with 10 vs 10,000
    registered adapters (the same 64 requests over 8 of them), and add_request / schedule with 10,000
    requests waiting behind a full batch."""
    adapter_dirs = build_adapters(base.parent / "book", config, 8, 8)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(32)] for _ in range(64)]
    per_step = {}
    for registered in (10, 10_000):
        engine = new_engine(base, adapter_dirs)
        for i in range(registered - len(adapter_dirs)):
            engine.register_adapter(f"{i:064x}", base / "never-read")
        digests = list(adapter_dirs)
        run(engine, prompts[:8], digests, 2)  # warm: the 8 adapters are loaded
        timings = []
        original = engine.scheduler.schedule

        def timed(original=original, timings=timings):
            start = time.perf_counter()
            out = original()
            timings.append(time.perf_counter() - start)
            return out

        engine.scheduler.schedule = timed
        run(engine, prompts, [digests[i % 8] for i in range(64)], 16)
        per_step[registered] = (sorted(timings)[len(timings) // 2] * 1000.0, min(timings) * 1000.0)
    (median10, min10), (median10k, min10k) = per_step[10], per_step[10_000]
    print(f"schedule() per step with 10 / 10,000 registered adapters: median {median10:.3f} / {median10k:.3f} ms "
          f"({median10k / median10:.2f}x), fastest {min10:.3f} / {min10k:.3f} ms ({min10k / min10:.2f}x)")
    engine = new_engine(base, {})
    sampling = SamplingParams(max_tokens=1000, ignore_eos=True)
    for i in range(engine.config.max_num_seqs + 10_000):
        engine.add_request(f"w{i}", [rng.randrange(3, VOCAB) for _ in range(16)], sampling, tenant=f"t{i % 50}")
    engine.scheduler.schedule()  # the batch is full from here on
    start = time.perf_counter()
    engine.add_request("one-more", [5] * 16, sampling, tenant="t0")
    added = time.perf_counter() - start
    start = time.perf_counter()
    engine.scheduler.schedule()
    scheduled = time.perf_counter() - start
    print(f"with {len(engine.scheduler.waiting)} waiting: add_request {added * 1000:.3f} ms, "
          f"schedule() {scheduled * 1000:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--queued", type=int, default=1000, help="requests on distinct adapters for the batch size")
    parser.add_argument("--rounds", type=int, default=3, help="alternated runs of each case; medians are printed")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--bookkeeping", action="store_true", help="only the host bookkeeping figures")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        base, config = build_base(Path(tmp), args.hidden, args.layers)
        if args.bookkeeping:
            bookkeeping(base, config, rng)
            return
        adapter_dirs = build_adapters(Path(tmp), config, args.adapters, args.rank)
        digests = list(adapter_dirs)
        prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(16, 64))] for _ in range(args.requests)]
        distinct = [digests[i % len(digests)] for i in range(args.requests)]
        scenarios = {
            "distinct": distinct,
            "distinct-cold": distinct,
            "none": [None] * args.requests,
            "one": [digests[0]] * args.requests,
        }
        seconds: dict[str, list[float]] = {name: [] for name in scenarios}
        loading = []
        for round_ in range(args.rounds):  # alternated, each round in another order: the machine's load drifts
            order = list(scenarios)[round_ % len(scenarios):] + list(scenarios)[: round_ % len(scenarios)]
            for name in order:
                names = scenarios[name]
                engine = new_engine(base, adapter_dirs)
                run(engine, prompts[:4], names[:4], 4)  # warm up (and, for distinct, load 4 of the 256)
                if name == "distinct":
                    loading.append(load_to_host(engine, sorted(set(names))))
                elapsed, tokens, _ = run(engine, prompts, names, args.max_tokens)
                seconds[name].append(elapsed)
        engine = new_engine(base, adapter_dirs)
        queued = min(args.queued, len(digests))
        queue_prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(16, 64))] for _ in range(queued)]
        _, _, batch = run(engine, queue_prompts, digests[:queued], 16, queued_stats=True)
        max_seqs = engine.config.max_num_seqs
    tokens = args.requests * args.max_tokens
    tps = {name: tokens / statistics.median(runs) for name, runs in seconds.items()}
    print(f"Llama hidden {args.hidden}, {args.layers} layers, vocab {VOCAB}; {args.adapters} registered adapters "
          f"(rank {args.rank}, all seven projections); {args.requests} requests x {args.max_tokens} tokens; "
          f"default config; torch threads {torch.get_num_threads()}; load average {load_before:.2f} -> "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for name in scenarios:
        runs = ", ".join(f"{t:.2f}" for t in seconds[name])
        print(f"{name:13s} {tps[name]:9.1f} tokens/s  (median of {len(seconds[name])}: {runs} s)")
    print(f"reading the {len(set(distinct))} distinct adapters from disk into the host cache before 'distinct': "
          f"{statistics.median(loading):.2f} s ({statistics.median(loading) / len(set(distinct)) * 1000:.1f} ms each; "
          f"median of {len(loading)})")
    print(f"distinct/none {tps['distinct'] / tps['none']:.2f}   distinct/one {tps['distinct'] / tps['one']:.2f}   "
          f"one/none {tps['one'] / tps['none']:.2f}   distinct-cold/none {tps['distinct-cold'] / tps['none']:.2f}   "
          f"distinct-cold/one {tps['distinct-cold'] / tps['one']:.2f}")
    print(f"mean batch size with {queued} distinct adapters queued: {batch:.1f} of max_num_seqs {max_seqs} "
          f"({batch / max_seqs:.0%})")


if __name__ == "__main__":
    main()
