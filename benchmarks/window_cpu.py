"""Sliding-window attention on the CPU path (the references): a windowed step against the same step over
the whole context, side by side in one process.

    .venv/bin/python -m benchmarks.window_cpu                 # Mistral-7B heads (32 q, 8 kv, 128), 8k context, window 512
    .venv/bin/python -m benchmarks.window_cpu --context 2048 --window 256 --threads 1

Each case prints the median time of the full-context call, of the windowed call, and their ratio: the
references read only the blocks from the one each window starts in.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import reference  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4, help="decode sequences")
    parser.add_argument("--chunk", type=int, default=256, help="new tokens of the prefill chunk")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block = 32, 8, 128, 16
    blocks = -(-args.context // block)
    shape = (args.batch * blocks, block, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    tables = torch.randperm(args.batch * blocks).int().view(args.batch, blocks)
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    q = torch.randn(args.batch, heads, head_dim)
    qp = torch.randn(args.chunk, heads, head_dim)
    cu = torch.tensor([0, args.chunk], dtype=torch.int32)
    cases = {
        f"decode B={args.batch}": lambda w: reference.paged_attention_decode(
            q, k_cache, v_cache, tables, lens, 0.09, window=w),
        f"prefill chunk={args.chunk}": lambda w: reference.paged_attention_prefill(
            qp, k_cache, v_cache, cu, tables[:1], lens[:1], 0.09, window=w),
    }  # fmt: skip
    print(f"CPU, {args.threads} thread(s), float32, heads 32/8 x 128, context {args.context}, window {args.window}")
    print("| case | full context ms | windowed ms | ratio |")
    print("|---|---:|---:|---:|")
    for name, run in cases.items():
        full = median_ms(lambda run=run: run(None), args.repeats)
        windowed = median_ms(lambda run=run: run(args.window), args.repeats)
        print(f"| {name} | {full:.1f} | {windowed:.1f} | {full / windowed:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
