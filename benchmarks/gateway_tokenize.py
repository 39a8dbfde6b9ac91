"""The gateway's prompt token counting (admission's, gateway/prompt_tokens.py) against a plain count (the whole
rendered prompt encoded), side by side in one process: CPU per prompt (time.process_time: every thread of the process, so a
thread pool's work would show) with the demo tokenizer (var/demo-model, GPT-2's shape) and a byte-level BPE of 3,700
tokens built here (Llama 3's and Qwen's shape: tests/gateway/bpe_tokenizer.py).

    .venv/bin/python -m benchmarks.gateway_tokenize [--rounds 3] [--budget-ms 60] [--sizes 16 256 1024 4096]

Prompts of each size in bytes: `text`, a completion's prompt; `chat`, one user message; `system`, a system prompt of
that size that all requests share and a user message of 64 bytes (an application's requests). Each round cycles
through the same 64 distinct prompts in each column: `plain` (the whole rendered prompt encoded), `new` (`count_prompt_tokens` without a tenant: no counts kept), `no-pool` (the same with
TOKENIZERS_PARALLELISM=false, read on each call: does a one-text batch cost thread pool work?), `missed` (with a new
tenant every call: kept counts looked up, missed and stored, the cost of the cache when it never hits) and `kept`
(one tenant: its long segments' counts kept from the warm-up). Prints each column's median over the rounds and the
median [lowest, highest] of the rounds' new/plain ratio, and the median missed/plain and kept/plain. Every count is
checked equal to the plain one. Nothing else is asserted.
"""

import argparse
import asyncio
import functools
import itertools
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "quilt.settings.test")

import django  # noqa: E402

django.setup()

from engine.chat_prompt import template_messages  # noqa: E402
from engine.demo.builder import ensure_demo  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from gateway.caller import Target  # noqa: E402
from gateway.hot_settings import hot  # noqa: E402
from gateway.openai_request import parse_chat, parse_completion  # noqa: E402
from gateway.prompt_tokens import count_prompt_tokens, estimate_prompt_tokens  # noqa: E402
from tests.gateway.bpe_tokenizer import WORDS, build_bpe_checkpoint  # noqa: E402

PROMPTS_PER_SIZE = 64


def plain_prompt_tokens(generation, tokenizer: Tokenizer) -> int | None:
    """The plain count of a prompt's tokens: `encode`, with offsets."""
    if generation.messages is not None:
        try:
            text = tokenizer.apply_chat_template(template_messages(generation.messages), add_generation_prompt=True,
                                                 tools=generation.structure.get("tools"))  # fmt: skip
        except Exception:
            return None
        return len(tokenizer.hf.encode(text, add_special_tokens=False))
    counted = 0
    for prompt in generation.prompts:
        if isinstance(prompt, str):
            counted += len(tokenizer.hf.encode(prompt))
        elif isinstance(prompt, list):
            counted += len(prompt)
    return counted


async def count_plain(generation, target: Target, *, prompt_bytes: int | None = None) -> int:
    """count_prompt_tokens's admission path over the plain count: no counts kept, no segments."""
    if prompt_bytes is None:
        prompt_bytes = generation.prompt_bytes()
    tokenizer = plain_tokenizer(target.checkpoint_dir)
    counted = None
    if tokenizer is not None:
        prompts = generation.prompts
        if prompt_bytes > hot.QUILT_TOKENIZE_ABOVE_BYTES:
            counted = await asyncio.to_thread(plain_prompt_tokens, generation, tokenizer)
        elif prompts is not None and len(prompts) == 1 and prompts[0].__class__ is str:
            counted = len(tokenizer.hf.encode(prompts[0]))
        else:
            counted = plain_prompt_tokens(generation, tokenizer)
    return estimate_prompt_tokens(generation, prompt_bytes=prompt_bytes) if counted is None else counted


@functools.lru_cache(maxsize=32)
def plain_tokenizer(checkpoint_dir: str) -> Tokenizer:
    return Tokenizer(checkpoint_dir)


def a_text(rng: random.Random, size: int) -> str:
    """About `size` UTF-8 bytes of words, numbers, code and unicode (cut at a character boundary)."""
    out, length = [], 0
    while length < size:
        word = rng.choice(WORDS) + rng.choice([" ", " ", " ", ", ", ". ", "\n"])
        out.append(word)
        length += len(word.encode())
    return "".join(out).encode()[:size].decode(errors="ignore")


def generations(kind: str, size: int, seed: int) -> list:
    rng = random.Random(seed)
    if kind == "text":
        return [parse_completion({"model": "m", "prompt": a_text(rng, size)}) for _ in range(PROMPTS_PER_SIZE)]
    system = [{"role": "system", "content": a_text(rng, size)}] if kind == "system" else []
    return [parse_chat({"model": "m", "messages": [
        *system, {"role": "user", "content": a_text(rng, 64 if kind == "system" else size)}]})
        for _ in range(PROMPTS_PER_SIZE)]  # fmt: skip


async def cpu_us(count, batch: list, calls: int) -> tuple[float, list]:
    """CPU per call of `await count(generation, turn)` over `calls` turns through the batch, and the batch's counts."""
    counts = [await count(generation, -1) for generation in batch]  # warm: the BPE's word cache, kept counts
    start = time.process_time()
    for turn in range(calls):
        await count(batch[turn % len(batch)], turn)
    return (time.process_time() - start) / calls * 1e6, counts


def columns(model_dir: Path, tenants) -> dict:
    """Each column's `await count(generation, turn)`."""
    target = a_target(model_dir)

    async def plain(generation, turn):
        return await count_plain(generation, target)

    async def new(generation, turn):
        return await count_prompt_tokens(generation, target)

    async def missed(generation, turn):
        return await count_prompt_tokens(generation, target, tenant=next(tenants))

    async def kept(generation, turn):
        return await count_prompt_tokens(generation, target, tenant=1)

    return {"plain": plain, "new": new, "no-pool": new, "missed": missed, "kept": kept}


async def measure(args, models: dict) -> None:
    tenants = itertools.count(1_000_000)
    for name, model_dir in models.items():
        counters = columns(model_dir, tenants)
        for kind in ("text", "chat", "system"):
            for size in args.sizes:
                batch = generations(kind, size, seed=size)
                first, _ = await cpu_us(counters["plain"], batch, 20)
                calls = max(50, int(args.budget_ms * 1000 / first))
                rows = []
                for _ in range(args.rounds):
                    row = {}
                    for column, count in counters.items():
                        if column == "no-pool":
                            os.environ["TOKENIZERS_PARALLELISM"] = "false"
                        row[column], counts = await cpu_us(count, batch, calls)
                        os.environ.pop("TOKENIZERS_PARALLELISM", None)
                        if column == "plain":
                            expected = counts
                        elif counts != expected:
                            raise SystemExit(f"{name} {kind} {size} {column}: counts differ")
                    rows.append(row)
                line = f"{name:<9} {kind:<6} {size:>5} {statistics.mean(expected):>6.0f}"
                for column in counters:
                    line += f" {statistics.median(r[column] for r in rows):>8.1f}"
                ratios = [r["new"] / r["plain"] for r in rows]
                line += f"  {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
                for column in ("missed", "kept"):
                    line += f" {statistics.median(r[column] / r['plain'] for r in rows):>7.3f}"
                print(line, flush=True)


def a_target(model_dir: Path) -> Target:
    return Target(name="m", base_model="base", checkpoint_dir=str(model_dir), max_context=256, adapter_id=None,
                  adapter_version_id=None, adapter_version=None, digest=None, adapter_path=None)  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-ms", type=float, default=60, help="CPU per column, cell and round, about")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 256, 1024, 4096])
    args = parser.parse_args(argv)
    own = build_bpe_checkpoint(Path(tempfile.mkdtemp(prefix="gateway-tokenize-")))
    models = {"demo": ensure_demo(REPO / "var" / "demo-model", log=lambda line: None), "bpe-3.7k": own}
    print(f"{'tokenizer':<9} {'kind':<6} {'bytes':>5} {'tokens':>6} {'plain us':>8} {'new us':>8} {'no-pool':>8} "
          f"{'missed':>8} {'kept':>8}  new/plain median [low, high] over {args.rounds} rounds, missed/plain, kept/plain")
    asyncio.run(measure(args, models))
    return 0


if __name__ == "__main__":
    sys.exit(main())
