"""Split-K for the weight-streaming GEMMs of a decode step (kernels/wna16_linear.py, kernels/fp8_block_linear.py).

A decode step's few rows make few row blocks, so a launch has as many programs as column tiles: 64 for Llama-3-8B's
o and down projections, half of an H100/H200's 132 SMs, each running the whole reduction. Where that is too few,
the reduction is cut too: each split writes float32 partials [splits, T, N] and `sum_partials` adds them in a
fixed order (a result that does not depend on which split finishes first, as atomics would make it)."""

import torch
import triton
import triton.language as tl

from kernels.launch import cdiv

PROGRAMS_PER_SM = 2  # split until the launch has this many programs per SM ...
PARTIAL_SHARE = 4  # ... while the partials stay under 1 / PARTIAL_SHARE of the weight's bytes
SUM_BLOCK = 1024  # values per program of the sum


def split_k(programs: int, tiles: int, tokens: int, out_dim: int, weight_bytes: int, sms: int) -> int:
    """The least power of two of splits that gives `programs` (row blocks x column tiles) PROGRAMS_PER_SM per SM,
    each split keeping at least one of the `tiles` steps of the reduction and the partials (4 bytes per token and
    output per split) under 1 / PARTIAL_SHARE of the weight's bytes."""
    split = 1
    while (programs * split < PROGRAMS_PER_SM * sms and 2 * split <= tiles
           and 2 * split * tokens * out_dim * 4 * PARTIAL_SHARE <= weight_bytes):
        split *= 2
    return split


def split_tiles(tiles: int, split: int) -> tuple[int, int]:
    """(steps of the reduction per split, splits that have one): the splits a launch runs."""
    per = cdiv(tiles, split)
    return per, cdiv(tiles, per)


@triton.jit(do_not_specialize=["numel"])  # numel follows the token count
def _sum_kernel(partial_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(partial_ptr + offs, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLIT_K):
        acc += tl.load(partial_ptr + split * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_partials(partials: torch.Tensor, out: torch.Tensor) -> None:
    """out[t, n] = sum over s, in order, of partials[s, t, n]: partials [S, T, N] float32 and out [T, N], both
    contiguous."""
    numel = out.numel()
    _sum_kernel[(cdiv(numel, SUM_BLOCK),)](partials, out, numel, SPLIT_K=partials.shape[0], BLOCK=SUM_BLOCK)
