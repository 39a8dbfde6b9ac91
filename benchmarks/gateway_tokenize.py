"""The gateway's prompt token counting (admission's, gateway/prompt_tokens.py) against the code before issue 37 item
23's sixth pass, side by side in one process: CPU per prompt (time.process_time: every thread of the process, so a
thread pool's work would show) for completion texts and one-message chats of 16 to 4096 bytes, with the demo
tokenizer (var/demo-model, GPT-2's shape) and a byte-level BPE of 3,700 tokens built here (Llama 3's and Qwen's shape:
tests/gateway/bpe_tokenizer.py).

    .venv/bin/python -m benchmarks.gateway_tokenize [--rounds 5] [--budget-ms 150] [--sizes 16 256 1024 4096]

Old and new run on their own tokenizer instances, each round over the same distinct prompts (64 of each size, made
of words and unicode), old then new then new with TOKENIZERS_PARALLELISM=false (the variable is read on each
call): the last column says whether a one-text batch costs any thread pool work. Prints each cell's median over the
rounds and the median, lowest and highest of the rounds' new/old ratios. Every count is checked equal. Nothing is
asserted beyond that.
"""

import argparse
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

from engine.demo.builder import ensure_demo  # noqa: E402
from engine.server.structured import template_messages  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from gateway.openai_request import parse_chat, parse_completion  # noqa: E402
from gateway.prompt_tokens import prompt_tokens  # noqa: E402
from tests.gateway.bpe_tokenizer import WORDS, build_bpe_checkpoint  # noqa: E402

PROMPTS_PER_SIZE = 64


def prompt_tokens_before(generation, tokenizer: Tokenizer) -> int | None:
    """gateway.prompt_tokens.prompt_tokens as it was (5d42326..27dad89): `encode`, with offsets."""
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


def tokenizer_before(model_dir: Path) -> Tokenizer:
    """The tokenizer as it was: its chat template's globals jinja2's ChainMap over the environment's."""
    tokenizer = Tokenizer(model_dir)
    if tokenizer._template is not None:
        tokenizer._template.globals = tokenizer._template.environment.make_globals(None)
    return tokenizer


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
    return [parse_chat({"model": "m", "messages": [{"role": "user", "content": a_text(rng, size)}]})
            for _ in range(PROMPTS_PER_SIZE)]  # fmt: skip


def cpu_us(count, tokenizer: Tokenizer, batch: list, calls: int) -> tuple[float, list]:
    counts = [count(generation, tokenizer) for generation in batch]  # warm: the BPE's word cache, jinja2
    start = time.process_time()
    for i in range(calls):
        count(batch[i % len(batch)], tokenizer)
    return (time.process_time() - start) / calls * 1e6, counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget-ms", type=float, default=150, help="CPU per cell and round, about")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 256, 1024, 4096])
    args = parser.parse_args(argv)
    own = build_bpe_checkpoint(Path(tempfile.mkdtemp(prefix="gateway-tokenize-")))
    models = {"demo": ensure_demo(REPO / "var" / "demo-model", log=lambda line: None), "bpe-3.7k": own}
    print(f"{'tokenizer':<9} {'kind':<4} {'bytes':>5} {'tokens':>6} {'old us':>8} {'new us':>8} {'no-pool':>8}  "
          f"new/old median [low, high] over {args.rounds} rounds")  # fmt: skip
    for name, model_dir in models.items():
        old, new = tokenizer_before(model_dir), Tokenizer(model_dir)
        for kind in ("text", "chat"):
            for size in args.sizes:
                batch = generations(kind, size, seed=size)
                first, _ = cpu_us(prompt_tokens_before, old, batch, 20)
                calls = max(50, int(args.budget_ms * 1000 / first))
                rows = []
                for _ in range(args.rounds):
                    before, expected = cpu_us(prompt_tokens_before, old, batch, calls)
                    after, counts = cpu_us(prompt_tokens, new, batch, calls)
                    os.environ["TOKENIZERS_PARALLELISM"] = "false"
                    serial, _ = cpu_us(prompt_tokens, new, batch, calls)
                    del os.environ["TOKENIZERS_PARALLELISM"]
                    if counts != expected:
                        raise SystemExit(f"{name} {kind} {size}: counts differ")
                    rows.append((before, after, serial))
                ratios = [after / before for before, after, _ in rows]
                tokens = statistics.mean(expected)
                print(f"{name:<9} {kind:<4} {size:>5} {tokens:>6.0f} {statistics.median(r[0] for r in rows):>8.1f} "
                      f"{statistics.median(r[1] for r in rows):>8.1f} {statistics.median(r[2] for r in rows):>8.1f}  "
                      f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
