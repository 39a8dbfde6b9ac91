"""Constrained decoding on CPU: a batch where half the requests follow JSON schemas, against the same batch free.

    .venv/bin/python -m benchmarks.structured [--batch 64] [--hidden 128 --layers 4] [--rank 8] [--steps 24]
        [--rounds 3] [--schemas-seed 0]

A small random Llama with a byte-level BPE tokenizer (the demo's) and `--batch` random rank-r adapters, every
request on its own adapter, all of them resident before timing. Each round runs the batch twice, alternating: half
the requests constrained, each by a different random schema (tests/engine/structured_schemas.py: nested objects,
arrays, enums, bounded numbers, optional fields; each followed by a 160-character note, so that no constrained
request ends within the timed steps), and the same requests unconstrained. Step time is the mean over
the first `--steps` decode steps in which the whole batch runs (the median over rounds); the ratio is the goal
(within 10%), also as the median of each round's constrained/unconstrained pair (the two runs of a round are
seconds apart, so they see the same load from other processes). Also printed: each schema's compile time, cold (a fresh compiler) and cached, and the time llguidance
takes for one step's masks of the constrained half when nothing else runs (what the forward pass hides).
"""

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.many_adapters import build_adapters, build_base
from engine import SamplingParams
from engine.config import EngineConfig
from engine.demo import corpus
from engine.demo.tokenizer import save_tokenizer, train_tokenizer
from engine.grammar import GrammarCompiler, GrammarSpec
from engine.llm_engine import LLMEngine
from tests.engine.structured_schemas import random_schema


def build(root: Path, *, hidden: int, layers: int, adapters: int, rank: int):
    base, config = build_base(root, hidden, layers)
    tokenizer = train_tokenizer(corpus.tokenizer_corpus(random.Random(0), lines=500), vocab_size=config.vocab_size)
    save_tokenizer(tokenizer, base, max_length=1024)
    return base, build_adapters(root, config, adapters, rank)


def padded(schema: dict) -> dict:
    """The schema's value, then a note of 160 characters: every constrained request runs through the timed steps."""
    return {"type": "object", "properties": {"data": schema, "note": {"type": "string", "minLength": 160,
                                                                      "maxLength": 160}},
            "required": ["data", "note"], "additionalProperties": False}


def compile_times(base: Path, engine: LLMEngine, specs: list[GrammarSpec]) -> tuple[list[float], list[float]]:
    compiler = GrammarCompiler(base / "tokenizer.json", vocab_size=engine.runner.model.spec.vocab_size,
                               eos_token_ids=engine.eos_token_ids)
    assert compiler.tokenizer is not None  # built once per model, at the first compile: not a schema's cost
    cold, cached = [], []
    for times in (cold, cached):
        for spec in specs:
            start = time.perf_counter()
            compiler.compile(spec)
            times.append((time.perf_counter() - start) * 1000.0)
    return cold, cached


def run_batch(engine: LLMEngine, digests: list[str], prompts: list[list[int]], grammars: list, steps: int,
              tag: str) -> float:
    """Mean ms of the first `steps` decode steps with the whole batch running."""
    for i, (digest, prompt, grammar) in enumerate(zip(digests, prompts, grammars, strict=True)):
        sampling = SamplingParams(temperature=1.0, seed=i, max_tokens=steps + 200, ignore_eos=grammar is None)
        engine.add_request(f"{tag}-{i}", prompt, sampling, adapter=digest, grammar=grammar)
    times = []
    engine.step()  # the prefill
    while engine.has_unfinished() and len(times) < steps:
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if engine.last_step_seqs == len(prompts):
            times.append(elapsed * 1000.0)
    for i in range(len(prompts)):
        engine.abort(f"{tag}-{i}")
    if len(times) < steps:
        raise RuntimeError(f"only {len(times)} full-batch decode steps (a request ended early)")
    return statistics.mean(times)


def mask_ms(engine: LLMEngine, grammars: list, repeats: int = 20) -> float:
    """One step's masks for the constrained half, alone (what runs beside the forward pass)."""
    from engine.sequence import Sequence

    guided = engine.guided
    seqs = [Sequence(request_id=f"mask-{i}", index=0, prompt_token_ids=[1], sampling=SamplingParams(), adapter=None,
                     tenant="t", weight=1.0, cache_salt="s", arrival_time=0.0, constrained=True)
            for i in range(len(grammars))]
    for seq, grammar in zip(seqs, grammars, strict=True):
        guided.add(seq, grammar)
    guided.allowed(guided.start(seqs), seqs)  # warm
    start = time.perf_counter()
    for _ in range(repeats):
        guided.allowed(guided.start(seqs), seqs)
    elapsed = (time.perf_counter() - start) * 1000.0 / repeats
    for seq in seqs:
        guided.release(seq)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schemas-seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base, adapter_dirs = build(Path(tmp), hidden=args.hidden, layers=args.layers, adapters=args.batch,
                                   rank=args.rank)
        engine = LLMEngine(EngineConfig(model=str(base), max_num_seqs=args.batch, max_adapter_rank=args.rank))
        digests = list(adapter_dirs)
        for digest, path in adapter_dirs.items():
            engine.register_adapter(digest, path)
        for digest in digests:
            while engine.adapter_pool.tier(digest) != "host":
                engine.adapter_pool.ready(digest)  # starts its read from disk
                time.sleep(0.01)
            engine.prefetch_adapter(digest, "device")
        rng = random.Random(args.schemas_seed)
        half = args.batch // 2
        specs = [GrammarSpec.json_schema(padded(random_schema(rng)), param="response_format") for _ in range(half)]
        cold, cached = compile_times(base, engine, specs)
        grammars = [engine.grammars.compile(spec) for spec in specs]
        constrained = [grammars[i // 2] if i % 2 == 0 else None for i in range(args.batch)]  # every other request
        prompts = [engine.tokenizer.encode(corpus.sentence(rng)) for _ in range(args.batch)]
        free_ms, guided_ms = [], []
        for r in range(args.rounds):
            guided_ms.append(run_batch(engine, digests, prompts, constrained, args.steps, f"c{r}"))
            free_ms.append(run_batch(engine, digests, prompts, [None] * args.batch, args.steps, f"f{r}"))
        alone = mask_ms(engine, grammars)
    free, guided = statistics.median(free_ms), statistics.median(guided_ms)
    print(f"model: hidden {args.hidden}, {args.layers} layers; batch {args.batch}, each request on its own rank-"
          f"{args.rank} adapter; {half} constrained by {half} different schemas; torch threads "
          f"{torch.get_num_threads()}")
    print(f"compile per schema, cold: median {statistics.median(cold):.2f} ms, max {max(cold):.2f} ms; cached: "
          f"median {statistics.median(cached) * 1000:.1f} us")
    print(f"masks of {half} constrained sequences, alone: {alone:.2f} ms per step")
    print(f"step time, unconstrained: {free:.2f} ms (rounds {', '.join(f'{t:.2f}' for t in free_ms)})")
    print(f"step time, half constrained: {guided:.2f} ms (rounds {', '.join(f'{t:.2f}' for t in guided_ms)})")
    paired = statistics.median(g / f for g, f in zip(guided_ms, free_ms, strict=True))
    print(f"ratio constrained / unconstrained: {guided / free:.3f} of the medians, {paired:.3f} the median of each "
          f"round's pair (goal: at most 1.10)")


if __name__ == "__main__":
    main()
