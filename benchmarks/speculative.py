"""Speculative decoding on vs off, side by side in one process, on a repetitive and a non-repetitive workload.

    .venv/bin/python -m benchmarks.speculative [--demo-dir var/demo-model] [--requests 64] [--concurrency 8]
        [--k 4] [--rounds 3] [--threads 1] [--methods ngram ngram-always] [--draft DIR] [--quick]
        [--model DIR | --random-model] [--device cpu]

The model is the demo checkpoint (`python -m engine.demo`, built on first use, about a minute): a tiny
Llama trained to echo the user's sentence, with LoRA adapters that shout it, reverse its words or count
them. Workloads, greedy, chat-templated sentences of the demo corpus:

    quote    the base model answers by quoting the prompt (repetitive: the answer is in the prompt)
    lora     the "reverse" and "count" adapters, alternating (non-repetitive: no n-gram of the answer
             follows the same n-gram in the prompt)
    mixed    half quote, half lora, in one batch (the policy decides per request)
    noise    a random (untrained) Llama of the demo's shape with a 256-token vocabulary, on prompts of random
             token ids, a run of 8 repeated 3 times: its output often repeats a pair of tokens seen before,
             so n-gram lookup proposes, but what followed then rarely follows now (the proposals are mostly
             rejected: the case the adaptive policy must switch off)

Methods: off; ngram and draft with the engine's default policy; ngram-always with the adaptive policy
disabled (speculative_min_acceptance 0), to show what switching off saves.

For each workload and each method (off, then ngram and/or draft) the same requests run on one engine per
method, `--concurrency` at a time; one warm-up run, then `--rounds` runs alternated between the methods (each round
starting with the next one).
Printed per cell: engine steps, tokens a sequence gets per step it samples in, acceptance rate, the median
wall-clock time and the speedup over off, the same ratio of this process's CPU time (one torch thread),
whether the outputs equal off's (they must: greedy), and the warm-up run on the fresh engine (the policy
has learnt nothing yet there: steps, tokens proposed/accepted, wall time).
`--quick` is a smoke run (few requests, one round); with `--model DIR` it uses that checkpoint and random
token-id prompts instead of the demo (steps and speedups then mean nothing); `--random-model` runs only the
noise workload (no demo to build).
"""

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

WORKLOADS = ("quote", "lora", "mixed", "noise")


def demo_requests(demo_dir: Path, workload: str, count: int, seed: int) -> list[tuple[list[int], str | None]]:
    from engine.demo import corpus
    from engine.demo.tokenizer import chat_prompt
    from engine.tokenizer import Tokenizer

    tokenizer, rng = Tokenizer(demo_dir), random.Random(seed)
    out = []
    for i in range(count):
        prompt = tokenizer.encode(chat_prompt(corpus.any_sentence(rng)))
        quote = workload == "quote" or (workload == "mixed" and i % 2 == 0)
        out.append((prompt, None if quote else ("reverse", "count")[(i // 2) % 2]))
    return out


def token_requests(vocab: int, count: int, seed: int) -> list[tuple[list[int], str | None]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(6, vocab, (8,), generator=gen).tolist() * 3, None) for _ in range(count)]


def demo_draft(demo_dir: Path, out: Path, *, steps: int = 300) -> Path:
    """A draft for the demo (cached in `out`): one layer of hidden 64 with the demo's tokenizer, trained for
    `steps` on the demo's base corpus (echoes and named skills, no adapter)."""
    import shutil

    from tokenizers import Tokenizer as HFTokenizer

    from engine.demo import corpus
    from engine.demo.trainer import llama_config, new_base_model, train

    if (out / "model.safetensors").exists():
        return out
    tokenizer = HFTokenizer.from_file(str(demo_dir / "tokenizer.json"))
    model = new_base_model(llama_config(tokenizer, hidden=64, layers=1, max_positions=256), seed=1)
    train(model, tokenizer, corpus.base_example, steps=steps, batch_size=32, lr=5e-3, seed=2, log=print)
    staging = out.parent / f".{out.name}.building"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (demo_dir / name).exists():
            shutil.copy(demo_dir / name, staging / name)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def random_model(directory: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, initializer_range=0.1,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


class Cell:
    """One method on one workload: its engine and what its runs measured."""

    def __init__(self, model: str, adapters: dict[str, Path], concurrency: int, device: str, **spec) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, device=device, max_num_seqs=concurrency, **spec))
        self.digests = {name: self.engine.add_adapter(path) for name, path in adapters.items()}
        self.times: list[float] = []
        self.cpu_times: list[float] = []  # this process's CPU time: less sensitive to a busy machine
        self.steps = self.proposed = self.accepted = self.tokens = self.seq_steps = 0
        self.outputs: list[list[int]] = []
        self.batch = 0
        self.first = ""  # the warm-up run on the fresh engine: steps, proposed/accepted, wall

    def run(self, requests, params: SamplingParams, *, record: bool) -> None:
        e = self.engine
        before = (e.num_steps, e.num_generated_tokens, e.num_decode_seq_steps, *self._spec())
        for i, (prompt, adapter) in enumerate(requests):
            e.add_request(f"b{self.batch}-{i}", prompt, params,
                          adapter=self.digests[adapter] if adapter else None)
        self.batch += 1
        outputs: dict[str, list[int]] = {}
        start, cpu_start = time.perf_counter(), time.process_time()
        while e.has_unfinished():
            for out in e.step():
                if out.finished:
                    outputs[out.request_id] = out.token_ids
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        after = (e.num_steps, e.num_generated_tokens, e.num_decode_seq_steps, *self._spec())
        delta = [b - a for a, b in zip(before, after, strict=True)]
        if not record:
            self.first = f"{delta[0]}, {delta[3]}/{delta[4]}, {elapsed * 1000:.0f} ms"
            return
        self.times.append(elapsed)
        self.cpu_times.append(cpu)
        self.steps, self.tokens, self.seq_steps, self.proposed, self.accepted = delta
        self.outputs = [outputs[k] for k in sorted(outputs, key=lambda k: int(k.rsplit("-", 1)[1]))]

    def _spec(self) -> tuple[int, int]:
        s = self.engine.speculation_state()
        return s["proposed_tokens"], s["accepted_tokens"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo-dir", type=Path, default=Path("var/demo-model"))
    parser.add_argument("--model", help="a checkpoint to use instead of the demo (random token prompts)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", nargs="+", default=["ngram", "ngram-always"],
                        choices=["ngram", "ngram-always", "draft"])
    parser.add_argument("--draft", help="draft checkpoint for --methods draft (default, on the demo: a one-layer "
                        "draft trained for it into var/demo-draft)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--random-model", action="store_true", help="only the noise workload (no demo build)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    if args.quick:
        args.requests, args.rounds, args.max_tokens = min(args.requests, 6), 1, min(args.max_tokens, 12)
    if "draft" in args.methods and not args.draft and (args.model or args.random_model):
        parser.error("--methods draft needs --draft DIR")
    if args.model:
        model, adapters = args.model, {}
        vocab = json_vocab(Path(args.model))
        workloads = {"random": token_requests(vocab, args.requests, seed=0)}
    elif args.random_model:
        model, adapters, workloads = "", {}, {}
    else:
        from engine.demo.builder import adapter_dir, ensure_demo

        demo = ensure_demo(args.demo_dir)
        if "draft" in args.methods and not args.draft:
            args.draft = str(demo_draft(demo, args.demo_dir.parent / "demo-draft"))
        model, adapters = str(demo), {s: adapter_dir(demo, s) for s in ("reverse", "count")}
        workloads = {w: demo_requests(demo, w, args.requests, seed=7) for w in WORKLOADS if w != "noise"}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    specs = {"off": {}}
    for method in args.methods:
        specs[method] = {"speculative_method": method.removesuffix("-always"), "num_speculative_tokens": args.k,
                         **({"speculative_model": args.draft} if method == "draft" else {}),
                         **({"speculative_min_acceptance": 0.0} if method.endswith("-always") else {})}
    print(f"speculative decoding: {args.requests} requests, {args.concurrency} at a time, k={args.k}, "
          f"max_tokens {args.max_tokens}, {args.rounds} round(s), {args.threads} torch thread(s), {args.device}, "
          f"model {model or 'random'}")
    print("| workload | method | steps | steps off/on | tokens/step | acceptance | wall (median) | wall speedup "
          "| CPU time speedup | same output | first run: steps, proposed/accepted, wall |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for name, requests in workloads.items():
        cells = {m: Cell(model, adapters, args.concurrency, args.device, **spec) for m, spec in specs.items()}
        run_cells(name, cells, requests, params, args.rounds)
    if not args.model:
        with tempfile.TemporaryDirectory() as tmp:
            noise = str(random_model(Path(tmp) / "random"))
            cells = {m: Cell(noise, {}, args.concurrency, args.device, **spec) for m, spec in specs.items()
                     if m != "draft"}
            run_cells("noise", cells, token_requests(256, args.requests, seed=7), params, args.rounds)
    return 0


def run_cells(name: str, cells: dict[str, "Cell"], requests, params: SamplingParams, rounds: int) -> None:
    for cell in cells.values():
        cell.run(requests, params, record=False)  # warm-up
    order = list(cells.values())
    for r in range(rounds):  # alternated, each round starting with the next method (no method always runs first)
        for cell in order[r % len(order) :] + order[: r % len(order)]:
            cell.run(requests, params, record=True)
    off = cells["off"]
    for method, cell in cells.items():
        t, cpu = statistics.median(cell.times), statistics.median(cell.cpu_times)
        acceptance = f"{cell.accepted / cell.proposed:.2f}" if cell.proposed else "-"
        print(f"| {name} | {method} | {cell.steps} | {off.steps / cell.steps:.2f}× | "
              f"{cell.tokens / max(cell.seq_steps, 1):.2f} | {acceptance} | {t * 1000:.0f} ms | "
              f"{statistics.median(off.times) / t:.2f}× | {statistics.median(off.cpu_times) / cpu:.2f}× | "
              f"{'yes' if cell.outputs == off.outputs else 'NO'} | {cell.first} |")


def json_vocab(model_dir: Path) -> int:
    from engine.models import read_hf_config

    return read_hf_config(model_dir)["vocab_size"]


if __name__ == "__main__":
    raise SystemExit(main())
