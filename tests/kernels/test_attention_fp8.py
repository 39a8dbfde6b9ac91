"""The fp8 KV cache: store_kv quantizing per token and head, both attention kernels reading fp8 pages.

Triton's interpreter (3.6) reads float8_e4m3fn correctly but rounds float32 -> fp8 wrongly when the
mantissa carries into the exponent (1.95 becomes 1.0, not 2.0), so under the interpreter store_kv is
checked on values that need no rounding; the rounding itself is checked on a GPU (`gpu` marker)."""

import math

import pytest
import torch

from kernels import reference
from kernels.reference import FP8, FP8_MAX
from tests.kernels.conftest import load_triton_op
from tests.kernels.test_attention import LAYOUTS, PREFILL_BATCHES


def _fp8_cache(layout, context_lens, device, seed=0):
    """Random K/V written by the reference store_kv into fp8 pages, blocks permuted; -1 pads the tables."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // layout.block_size) for n in context_lens]
    num_blocks = sum(per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(context_lens), max(per_seq) + 1), -1, dtype=torch.int32)
    slots, used = [], 0
    for b, (count, n) in enumerate(zip(per_seq, context_lens, strict=True)):
        tables[b, :count] = perm[used : used + count].int()
        used += count
        slots += [int(tables[b, j // layout.block_size]) * layout.block_size + j % layout.block_size for j in range(n)]
    tokens = len(slots)
    k = torch.randn(tokens, layout.kv_heads, layout.head_dim, generator=gen) * 3
    v = torch.randn(tokens, layout.kv_heads, layout.head_dim, generator=gen)
    shape = (num_blocks, layout.block_size, layout.kv_heads, layout.head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8)
    k_scales, v_scales = torch.zeros(shape[:3]), torch.zeros(shape[:3])
    reference.store_kv(k, v, k_cache, v_cache, torch.tensor(slots), k_scales, v_scales)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    caches = [t.to(device) for t in (k_cache, v_cache, k_scales, v_scales)]
    return caches, tables.to(device), lens.to(device), (k, v, torch.tensor(slots))


def test_reference_store_kv_fp8_round_trip_is_within_one_fp8_step():
    layout = LAYOUTS["bs16-gqa4-d40"]
    (k_cache, _, k_scales, _), _, _, (k, _, slots) = _fp8_cache(layout, [37, 5], "cpu")
    blk, off = slots // layout.block_size, slots % layout.block_size
    stored = k_cache[blk, off].float() * k_scales[blk, off][..., None]  # [T, kvh, D]
    assert torch.equal(k_scales[blk, off], k.abs().amax(-1) / FP8_MAX)
    step = torch.maximum(k.abs() / 16, k_scales[blk, off][..., None] * 2.0**-9)  # 3 mantissa bits; subnormals
    assert ((stored - k).abs() <= step).all()
    assert (stored - k).abs().max() > 0  # it is quantized


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_store_kv_fp8_matches_reference_on_exact_values(layout, device):
    """Values v * 2**e with v an fp8 value and each row's largest |v| = 448: the scale is 2**e and
    nothing rounds, so the bytes must be identical."""
    gen = torch.Generator().manual_seed(layout.head_dim)
    tokens = 11
    fp8_values = torch.randint(-126, 127, (2, tokens, layout.kv_heads, layout.head_dim), generator=gen,
                               dtype=torch.int8).view(FP8).float().nan_to_num(0.0).clamp(-FP8_MAX, FP8_MAX)
    fp8_values[..., 3] = FP8_MAX
    fp8_values[0, 4, 0] = 0.0  # an all-zero row
    exponent = torch.randint(-8, 4, (2, tokens, layout.kv_heads, 1), generator=gen).float()
    k, v = (fp8_values * 2.0**exponent).to(device)
    slots = torch.randperm(3 * layout.block_size, generator=gen)[:tokens]
    slots[5] = -1
    shape = (3, layout.block_size, layout.kv_heads, layout.head_dim)
    got = [torch.zeros(shape, dtype=FP8, device=device), torch.zeros(shape, dtype=FP8, device=device),
           torch.zeros(shape[:3], device=device), torch.zeros(shape[:3], device=device)]
    load_triton_op("store_kv")(k, v, got[0], got[1], slots.to(device), got[2], got[3])
    want = [torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8), torch.zeros(shape[:3]),
            torch.zeros(shape[:3])]
    reference.store_kv(k.cpu(), v.cpu(), want[0], want[1], slots, want[2], want[3])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu().view(torch.uint8) if g.dtype == FP8 else g.cpu(),
                           w.view(torch.uint8) if w.dtype == FP8 else w)


@pytest.mark.gpu
def test_store_kv_fp8_rounds_like_reference():
    layout = LAYOUTS["bs16-gqa4-d40"]
    (k_ref, v_ref, ks_ref, vs_ref), tables, lens, (k, v, slots) = _fp8_cache(layout, [37, 70], "cpu")
    got = [torch.zeros_like(t, device="cuda") for t in (k_ref, v_ref, ks_ref, vs_ref)]
    load_triton_op("store_kv")(k.cuda(), v.cuda(), got[0], got[1], slots.cuda(), got[2], got[3])
    torch.testing.assert_close(got[2].cpu(), ks_ref, atol=0, rtol=1e-6)
    for g, want in ((got[0], k_ref), (got[1], v_ref)):
        differ = g.cpu().view(torch.uint8) != want.view(torch.uint8)
        assert differ.float().mean() < 1e-3  # GPU division may land a tie on the other side, rarely
        torch.testing.assert_close(g.cpu().float(), want.float(), atol=2.0**-9 * FP8_MAX, rtol=2.0**-3)


@pytest.mark.parametrize("partition", [0, 64], ids=["one-pass", "split-kv-64"])
@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_paged_attention_decode_fp8_matches_reference(layout, partition, device):
    (k_cache, v_cache, k_scales, v_scales), tables, lens, _ = _fp8_cache(layout, [1, 13, 69, 200], device)
    q = torch.randn(4, layout.heads, layout.head_dim).to(device)
    scale = 1 / math.sqrt(layout.head_dim)
    out = load_triton_op("paged_attention_decode")(q, k_cache, v_cache, tables, lens, scale, k_scales, v_scales,
                                                   partition_size=partition)
    expected = reference.paged_attention_decode(q.cpu(), k_cache.cpu(), v_cache.cpu(), tables.cpu(), lens.cpu(),
                                                scale, k_scales.cpu(), v_scales.cpu())
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("batch", list(PREFILL_BATCHES.values()), ids=list(PREFILL_BATCHES))
@pytest.mark.parametrize("layout", [LAYOUTS["bs16-gqa4-d40"], LAYOUTS["bs8-gqa1-d64"]], ids=["gqa4-d40", "d64"])
def test_paged_attention_prefill_fp8_matches_reference(layout, batch, device):
    (k_cache, v_cache, k_scales, v_scales), tables, lens, _ = _fp8_cache(layout, [c for c, _ in batch], device)
    cu = torch.tensor([0, *[n for _, n in batch]]).cumsum(0).to(device=device, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), layout.heads, layout.head_dim).to(device)
    args = (cu, tables, lens, 0.3)
    out = load_triton_op("paged_attention_prefill")(q, k_cache, v_cache, *args, k_scales, v_scales)
    expected = reference.paged_attention_prefill(q.cpu(), k_cache.cpu(), v_cache.cpu(), *[a.cpu() for a in args[:3]],
                                                 0.3, k_scales.cpu(), v_scales.cpu())
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_fp8_attention_is_close_to_full_precision():
    layout = LAYOUTS["bs16-gqa4-d40"]
    (k8, v8, ks, vs), tables, lens, (k, v, slots) = _fp8_cache(layout, [90, 33], "cpu")
    shape = (k8.shape[0], layout.block_size, layout.kv_heads, layout.head_dim)
    k32, v32 = torch.zeros(shape), torch.zeros(shape)
    reference.store_kv(k, v, k32, v32, slots)
    q = torch.randn(2, layout.heads, layout.head_dim, generator=torch.Generator().manual_seed(0))
    scale = 1 / math.sqrt(layout.head_dim)
    full = reference.paged_attention_decode(q, k32, v32, tables, lens, scale)
    fp8 = reference.paged_attention_decode(q, k8, v8, tables, lens, scale, ks, vs)
    relative = ((fp8 - full).norm() / full.norm()).item()
    assert 0 < relative < 0.1  # E4M3 keeps 3 mantissa bits: ~3% per value; 4.5-6.5% on this output (5 q seeds)


def test_fp8_cache_without_scales_is_refused(device):
    layout = LAYOUTS["bs8-gqa1-d64"]
    (k_cache, v_cache, _, _), tables, lens, _ = _fp8_cache(layout, [5], device)
    q = torch.randn(1, layout.heads, layout.head_dim).to(device)
    with pytest.raises(ValueError, match="needs its scales"):
        load_triton_op("paged_attention_decode")(q, k_cache, v_cache, tables, lens, 0.3)



@pytest.mark.parametrize("op", ["decode", "decode-split-kv", "prefill"])
def test_windowed_soft_capped_attention_fp8_matches_reference(op, device):
    layout = LAYOUTS["bs16-gqa4-d40"]
    window, softcap = 24, 4.0
    if op == "prefill":
        batch = PREFILL_BATCHES["cached-prefix-and-chunks"]
        (k_cache, v_cache, k_scales, v_scales), tables, lens, _ = _fp8_cache(layout, [c for c, _ in batch], device)
        cu = torch.tensor([0, *[n for _, n in batch]]).cumsum(0).to(device=device, dtype=torch.int32)
        q = (torch.randn(int(cu[-1]), layout.heads, layout.head_dim) * 3).to(device)
        out = load_triton_op("paged_attention_prefill")(q, k_cache, v_cache, cu, tables, lens, 0.3, k_scales,
                                                        v_scales, window=window, softcap=softcap)
        expected = reference.paged_attention_prefill(q.cpu(), k_cache.cpu(), v_cache.cpu(), cu.cpu(), tables.cpu(),
                                                     lens.cpu(), 0.3, k_scales.cpu(), v_scales.cpu(), window=window,
                                                     softcap=softcap)
    else:
        (k_cache, v_cache, k_scales, v_scales), tables, lens, _ = _fp8_cache(layout, [1, 13, 69, 200], device)
        q = (torch.randn(4, layout.heads, layout.head_dim) * 3).to(device)
        out = load_triton_op("paged_attention_decode")(q, k_cache, v_cache, tables, lens, 0.3, k_scales, v_scales,
                                                       window=window, softcap=softcap,
                                                       partition_size=64 if op == "decode-split-kv" else 0)
        expected = reference.paged_attention_decode(q.cpu(), k_cache.cpu(), v_cache.cpu(), tables.cpu(), lens.cpu(),
                                                    0.3, k_scales.cpu(), v_scales.cpu(), window=window,
                                                    softcap=softcap)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)
