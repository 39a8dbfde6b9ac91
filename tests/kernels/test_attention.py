"""Triton paged attention (decode, prefill) and store_kv against the references."""

import itertools
import math
from dataclasses import dataclass

import pytest
import torch

from kernels import reference
from tests.kernels.cases import DTYPES, assert_close
from tests.kernels.conftest import load_triton_op


@dataclass(frozen=True)
class Layout:
    block_size: int
    heads: int
    kv_heads: int
    head_dim: int


LAYOUTS = {
    "bs8-gqa1-d64": Layout(8, 2, 2, 64),
    "bs16-gqa4-d40": Layout(16, 8, 2, 40),
    "bs32-gqa8-d64": Layout(32, 8, 1, 64),
}


def _paged_cache(layout: Layout, context_lens: list[int], dtype, device, seed=0):
    """Caches with randomly permuted blocks; unused block-table entries are -1."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // layout.block_size) for n in context_lens]
    num_blocks = sum(per_seq) + 3
    shape = (num_blocks, layout.block_size, layout.kv_heads, layout.head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(context_lens), max(per_seq) + 1), -1, dtype=torch.int32)
    used = 0
    for b, count in enumerate(per_seq):
        tables[b, :count] = perm[used : used + count].int()
        used += count
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return k_cache, v_cache, tables.to(device), lens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partition", [0, 64], ids=["one-pass", "split-kv-64"])
@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_paged_attention_decode_matches_reference(layout, partition, dtype, device):
    context_lens = [1, 13, 69, 200]  # ends mid-block for every block size; 200 spans 4 partitions
    k_cache, v_cache, tables, lens = _paged_cache(layout, context_lens, dtype, device)
    q = torch.randn(len(context_lens), layout.heads, layout.head_dim).to(device=device, dtype=dtype)
    scale = 1 / math.sqrt(layout.head_dim)
    out = load_triton_op("paged_attention_decode")(q, k_cache, v_cache, tables, lens, scale, partition_size=partition)
    expected = reference.paged_attention_decode(q.cpu(), k_cache.cpu(), v_cache.cpu(), tables.cpu(), lens.cpu(), scale)
    assert out.dtype == dtype
    assert_close(out.cpu(), expected)


def test_paged_attention_decode_chooses_split_kv_for_long_contexts(device):
    layout = LAYOUTS["bs16-gqa4-d40"]
    k_cache, v_cache, tables, lens = _paged_cache(layout, [1100, 3], torch.float32, device)
    q = torch.randn(2, layout.heads, layout.head_dim, device=device)
    out = load_triton_op("paged_attention_decode")(q, k_cache, v_cache, tables, lens, 0.2)
    expected = reference.paged_attention_decode(q.cpu(), k_cache.cpu(), v_cache.cpu(), tables.cpu(), lens.cpu(), 0.2)
    assert_close(out.cpu(), expected)


PREFILL_BATCHES = {
    # (context length incl. new tokens, new tokens) per sequence
    "fresh-prompts": [(5, 5), (70, 70)],
    "cached-prefix-and-chunks": [(100, 30), (17, 1), (64, 64), (41, 40)],
    "single-token": [(1, 1)],
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", list(PREFILL_BATCHES.values()), ids=list(PREFILL_BATCHES))
@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_paged_attention_prefill_matches_reference(layout, batch, dtype, device):
    k_cache, v_cache, tables, lens = _paged_cache(layout, [c for c, _ in batch], dtype, device)
    cu = torch.tensor([0, *[n for _, n in batch]]).cumsum(0).to(device=device, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), layout.heads, layout.head_dim).to(device=device, dtype=dtype)
    scale = 1 / math.sqrt(layout.head_dim)
    out = load_triton_op("paged_attention_prefill")(q, k_cache, v_cache, cu, tables, lens, scale)
    expected = reference.paged_attention_prefill(
        q.cpu(), k_cache.cpu(), v_cache.cpu(), cu.cpu(), tables.cpu(), lens.cpu(), scale
    )
    assert out.dtype == dtype
    assert_close(out.cpu(), expected)


def test_prefill_of_one_token_equals_decode(device):
    layout = LAYOUTS["bs16-gqa4-d40"]
    k_cache, v_cache, tables, lens = _paged_cache(layout, [37, 5], torch.float32, device)
    q = torch.randn(2, layout.heads, layout.head_dim, device=device)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    prefill = load_triton_op("paged_attention_prefill")(q, k_cache, v_cache, cu, tables, lens, 0.3)
    decode = load_triton_op("paged_attention_decode")(q, k_cache, v_cache, tables, lens, 0.3)
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32], ids=lambda b: f"bs{b}")
def test_store_kv_matches_reference(block_size, dtype, device):
    tokens, kv_heads, head_dim = 10, 2, 40
    gen = torch.Generator().manual_seed(block_size)
    qkv = torch.randn(tokens, 3 * kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    k, v = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]  # strided views of a fused projection
    slots = torch.randperm(4 * block_size, generator=gen)[:tokens]
    slots[[2, 7]] = -1
    slots = slots.to(device)
    k_cache = torch.zeros(4, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    load_triton_op("store_kv")(k, v, k_cache, v_cache, slots)
    k_ref, v_ref = torch.zeros_like(k_cache).cpu(), torch.zeros_like(v_cache).cpu()
    reference.store_kv(k.cpu(), v.cpu(), k_ref, v_ref, slots.cpu())
    assert torch.equal(k_cache.cpu(), k_ref) and torch.equal(v_cache.cpu(), v_ref)


@pytest.mark.gpu
def test_paged_attention_decode_replays_in_a_cuda_graph():
    layout = LAYOUTS["bs16-gqa4-d40"]
    k_cache, v_cache, tables, lens = _paged_cache(layout, [300, 40], torch.bfloat16, "cuda")
    q = torch.randn(2, layout.heads, layout.head_dim, device="cuda", dtype=torch.bfloat16)
    decode = load_triton_op("paged_attention_decode")
    decode(q, k_cache, v_cache, tables, lens, 0.2)  # warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode(q, k_cache, v_cache, tables, lens, 0.2)
    lens.copy_(torch.tensor([301, 41], dtype=torch.int32))  # the next step: one more token each
    graph.replay()
    expected = reference.paged_attention_decode(q.cpu(), k_cache.cpu(), v_cache.cpu(), tables.cpu(), lens.cpu(), 0.2)
    assert_close(out.cpu(), expected)


WINDOWS = {  # (window, softcap)
    "window-1": (1, None),
    "window-5": (5, None),
    "window-40-softcap-3": (40, 3.0),
    "window-100": (100, None),  # split-KV: three partitions of 64 from the window's
    "softcap-30": (None, 30.0),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partition", [0, 64], ids=["one-pass", "split-kv-64"])
@pytest.mark.parametrize("case", list(WINDOWS.values()), ids=list(WINDOWS))
def test_windowed_soft_capped_decode_matches_reference(case, partition, dtype, device):
    window, softcap = case
    layout = LAYOUTS["bs16-gqa4-d40"]
    context_lens = [1, 13, 69, 200]  # 200 with a window: the splits before it are skipped
    k_cache, v_cache, tables, lens = _paged_cache(layout, context_lens, dtype, device)
    q = (torch.randn(len(context_lens), layout.heads, layout.head_dim) * 4).to(device=device, dtype=dtype)
    out = load_triton_op("paged_attention_decode")(q, k_cache, v_cache, tables, lens, 0.3, window=window,
                                                   softcap=softcap, partition_size=partition)
    expected = reference.paged_attention_decode(q.cpu(), k_cache.cpu(), v_cache.cpu(), tables.cpu(), lens.cpu(), 0.3,
                                                window=window, softcap=softcap)
    assert_close(out.cpu(), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", list(PREFILL_BATCHES.values()), ids=list(PREFILL_BATCHES))
@pytest.mark.parametrize("case", list(WINDOWS.values()), ids=list(WINDOWS))
@pytest.mark.parametrize("layout", [LAYOUTS["bs8-gqa1-d64"], Layout(16, 4, 2, 144)], ids=["bs8-d64", "bs16-d144"])
def test_windowed_soft_capped_prefill_matches_reference(layout, case, batch, dtype, device):
    """d144 takes KV tiles (32) narrower than query tiles (64): a row's first tiles may lie before its window."""
    window, softcap = case
    k_cache, v_cache, tables, lens = _paged_cache(layout, [c for c, _ in batch], dtype, device)
    cu = torch.tensor([0, *[n for _, n in batch]]).cumsum(0).to(device=device, dtype=torch.int32)
    q = (torch.randn(int(cu[-1]), layout.heads, layout.head_dim) * 4).to(device=device, dtype=dtype)
    out = load_triton_op("paged_attention_prefill")(q, k_cache, v_cache, cu, tables, lens, 0.2, window=window,
                                                    softcap=softcap)
    expected = reference.paged_attention_prefill(q.cpu(), k_cache.cpu(), v_cache.cpu(), cu.cpu(), tables.cpu(),
                                                 lens.cpu(), 0.2, window=window, softcap=softcap)
    assert_close(out.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_prefill_window_1_d144_is_each_querys_own_value(dtype, device):
    """An H200 found 1,454 of 43,200 elements off by up to 2.95 in fp16 here. With window 1 a query sees
    its own key alone, so its output is its own value row whatever the score. At d144 a query tile (64 rows)
    spans two KV tiles (32): rows 32-63 see nothing in the first one. Their running max must stay -inf
    there; a max of 0 carried on turned a very negative score into p = exp2(s) that underflows (fp16 at
    2^-24, float32 at 2^-149) while the float32 row sum kept it: 0 or 0/0 instead of v. Scores here reach
    hundreds below zero, so float32 fails too, under the interpreter."""
    layout = Layout(16, 4, 2, 144)
    batch = [(100, 70), (64, 64)]  # a cached prefix, a fresh prompt; both fill a whole query tile
    k_cache, v_cache, tables, lens = _paged_cache(layout, [c for c, _ in batch], dtype, device, seed=3)
    cu = torch.tensor([0, *[n for _, n in batch]]).cumsum(0).to(device=device, dtype=torch.int32)
    q = (torch.randn(int(cu[-1]), layout.heads, layout.head_dim, generator=torch.Generator().manual_seed(4)) * 40)
    q = q.to(device=device, dtype=dtype)
    out = load_triton_op("paged_attention_prefill")(q, k_cache, v_cache, cu, tables, lens, 0.2, window=1)
    expected = reference.paged_attention_prefill(q.cpu(), k_cache.cpu(), v_cache.cpu(), cu.cpu(), tables.cpu(),
                                                 lens.cpu(), 0.2, window=1)
    group = layout.heads // layout.kv_heads
    for b, (context, new) in enumerate(batch):  # the oracle itself: each query's own value row
        rows = slice(int(cu[b]), int(cu[b + 1]))
        slots = torch.arange(context - new, context)
        blocks = tables[b].cpu().long()[slots // layout.block_size]
        own = v_cache.cpu()[blocks, slots % layout.block_size]  # [new, kv_heads, D]
        torch.testing.assert_close(expected[rows], own.repeat_interleave(group, dim=1))
    assert torch.isfinite(out.cpu()).all()
    torch.testing.assert_close(out.cpu(), expected, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_window_skips_the_blocks_before_it(op, device):
    """Blocks wholly before every query's window are never read, by the launchers nor by the references:
    poisoning them (NaN) changes nothing."""
    layout = LAYOUTS["bs8-gqa1-d64"]
    k_cache, v_cache, tables, lens = _paged_cache(layout, [300], torch.float32, device)
    window, new = 20, 3 if op == "prefill" else 1
    first_needed = (300 - new + 1 - window) // layout.block_size  # the block of the first query's first key
    k_clean, v_clean = k_cache.cpu().clone(), v_cache.cpu().clone()
    for cache in (k_cache, v_cache):
        cache[tables[0, :first_needed].long()] = float("nan")
    q = torch.randn(new, layout.heads, layout.head_dim, device=device)
    if op == "decode":
        out = load_triton_op("paged_attention_decode")(q, k_cache, v_cache, tables, lens, 0.2, window=window,
                                                       partition_size=64)
        expected = reference.paged_attention_decode(q.cpu(), k_clean, v_clean, tables.cpu(), lens.cpu(), 0.2,
                                                    window=window)
    else:
        cu = torch.tensor([0, new], dtype=torch.int32, device=device)
        out = load_triton_op("paged_attention_prefill")(q, k_cache, v_cache, cu, tables, lens, 0.2, window=window)
        expected = reference.paged_attention_prefill(q.cpu(), k_clean, v_clean, cu.cpu(), tables.cpu(), lens.cpu(),
                                                     0.2, window=window)
    assert not out.isnan().any()
    assert_close(out.cpu(), expected)
    poisoned_args = (q.cpu(), k_cache.cpu(), v_cache.cpu())
    if op == "decode":
        poisoned = reference.paged_attention_decode(*poisoned_args, tables.cpu(), lens.cpu(), 0.2, window=window)
    else:
        poisoned = reference.paged_attention_prefill(*poisoned_args, cu.cpu(), tables.cpu(), lens.cpu(), 0.2,
                                                     window=window)
    assert torch.equal(poisoned, expected)


def test_attention_launchers_refuse_a_bad_window(device):
    layout = LAYOUTS["bs8-gqa1-d64"]
    k_cache, v_cache, tables, lens = _paged_cache(layout, [5], torch.float32, device)
    q = torch.randn(1, layout.heads, layout.head_dim, device=device)
    with pytest.raises(ValueError, match="window"):
        load_triton_op("paged_attention_decode")(q, k_cache, v_cache, tables, lens, 0.2, window=0)
    with pytest.raises(ValueError, match="softcap"):
        cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
        load_triton_op("paged_attention_prefill")(q, k_cache, v_cache, cu, tables, lens, 0.2, softcap=-1.0)


def _image_limits(batch) -> torch.Tensor:
    """key_limits [T] for each sequence's new tokens: runs of 4, 2, 6, 3, 9, 1, ... tokens, every other run text
    (each token sees up to itself) and the others "images" whose tokens all see the run's last token."""
    limits = []
    for context, new in batch:
        first = context - new
        row, at, runs = list(range(first, context)), 0, itertools.cycle([4, 2, 6, 3, 9, 1])
        for is_image in itertools.cycle([False, True]):
            if at >= new:
                break
            end = min(at + next(runs), new)
            if is_image:
                row[at:end] = [first + end - 1] * (end - at)
            at = end
        limits += row
    return torch.tensor(limits, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5], ids=["full", "window-5"])
@pytest.mark.parametrize("batch", list(PREFILL_BATCHES.values()), ids=list(PREFILL_BATCHES))
def test_prefill_with_key_limits_matches_reference(batch, window, dtype, device):
    """Spans of new tokens that attend both ways (Gemma 3's images), with and without a window."""
    layout = LAYOUTS["bs16-gqa4-d40"]
    k_cache, v_cache, tables, lens = _paged_cache(layout, [c for c, _ in batch], dtype, device)
    cu = torch.tensor([0, *[n for _, n in batch]]).cumsum(0).to(device=device, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), layout.heads, layout.head_dim).to(device=device, dtype=dtype)
    limits = _image_limits(batch).to(device)
    out = load_triton_op("paged_attention_prefill")(q, k_cache, v_cache, cu, tables, lens, 0.2, window=window,
                                                    key_limits=limits)
    expected = reference.paged_attention_prefill(q.cpu(), k_cache.cpu(), v_cache.cpu(), cu.cpu(), tables.cpu(),
                                                 lens.cpu(), 0.2, window=window, key_limits=limits.cpu())
    assert_close(out.cpu(), expected)


def test_reference_key_limits_are_a_mask_on_dense_attention():
    """The reference with key_limits against plain softmax attention over the sequence's keys, masked by hand."""
    layout = Layout(4, 2, 1, 8)
    context, new = 23, 15
    k_cache, v_cache, tables, lens = _paged_cache(layout, [context], torch.float32, "cpu", seed=3)
    q = torch.randn(new, layout.heads, layout.head_dim, generator=torch.Generator().manual_seed(4))
    limits = _image_limits([(context, new)])
    assert (limits > torch.arange(context - new, context)).any()  # some token sees past itself
    out = reference.paged_attention_prefill(q, k_cache, v_cache, torch.tensor([0, new]), tables, lens, 0.3,
                                            key_limits=limits)
    keys = torch.cat([k_cache[tables[0, i]] for i in range(-(-context // 4))])[:context, 0]  # [context, D]
    values = torch.cat([v_cache[tables[0, i]] for i in range(-(-context // 4))])[:context, 0]
    mask = torch.arange(context)[None, :] <= limits[:, None].long()  # [new, context]
    for head in range(layout.heads):
        scores = (q[:, head] @ keys.T * 0.3).masked_fill(~mask, float("-inf"))
        torch.testing.assert_close(out[:, head], torch.softmax(scores, dim=-1) @ values)
