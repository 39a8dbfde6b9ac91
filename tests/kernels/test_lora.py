"""Triton LoRA shrink/expand against the references (interpreted on CPU, native with CUDA)."""

from dataclasses import dataclass

import pytest
import torch

from kernels import LoRAMeta, reference
from kernels.slot_batch import SlotBatch
from tests.kernels.cases import DTYPES, assert_close
from tests.kernels.conftest import load_triton_op
from tests.kernels.paged_lora import to_pages


@dataclass(frozen=True)
class LoRACase:
    tokens: int
    in_dim: int
    ranks: tuple[int, ...]  # one per slot
    slices: tuple[int, ...]  # output width of each slice
    pattern: str  # how tokens pick slots: "mixed", "segments", "one-per-slot", "all-base"
    max_rank: int | None = None


CASES = {
    "single-token": LoRACase(1, 48, (8,), (40,), "mixed"),
    "qkv-mixed-ranks-1-to-128": LoRACase(37, 72, (1, 7, 16, 33, 64, 128), (64, 16, 16), "mixed"),
    "gate-up-prefill-segments": LoRACase(70, 40, (16, 4, 8), (96, 96), "segments"),
    "decode-64-slots": LoRACase(64, 40, tuple(1 + (i * 5) % 16 for i in range(64)), (24,), "one-per-slot"),
    "all-base-batch": LoRACase(9, 40, (8, 8), (24, 8), "all-base"),
    "slot-with-rank-0": LoRACase(12, 24, (0, 5), (20,), "mixed"),
    "split-k-long-input": LoRACase(2, 520, (16, 3), (33,), "mixed"),
    "padded-max-rank": LoRACase(5, 40, (3, 5), (17,), "mixed", max_rank=32),
}


def _token_slots(case: LoRACase, gen: torch.Generator) -> torch.Tensor:
    slots = len(case.ranks)
    if case.pattern == "all-base":
        return torch.full((case.tokens,), -1)
    if case.pattern == "one-per-slot":
        return torch.randperm(slots, generator=gen)[: case.tokens]
    if case.pattern == "segments":
        return torch.cat([torch.full((n,), s) for s, n in zip([0, -1, 2, 1], [30, 5, 20, 15], strict=True)])
    picked = torch.randint(-1, slots, (case.tokens,), generator=gen)
    picked[0] = slots - 1
    return picked


def _inputs(case: LoRACase, dtype: torch.dtype, device: str, index_dtype: torch.dtype, align: int = 1):
    gen = torch.Generator().manual_seed(sum(case.ranks) + case.tokens)
    slots, max_rank = len(case.ranks), case.max_rank or max(case.ranks)
    x = torch.randn(case.tokens, case.in_dim, generator=gen)
    # weights beyond each slot's rank are random, not zero: the kernels must not read them
    lora_a = torch.randn(len(case.slices), slots, max_rank, case.in_dim, generator=gen) / case.in_dim**0.5
    lora_b = torch.randn(slots, sum(case.slices), max_rank, generator=gen) / max_rank**0.5
    scaling = torch.rand(len(case.slices), slots, generator=gen) + 0.5
    token_slots = _token_slots(case, gen)
    offsets = tuple(int(v) for v in torch.tensor((0, *case.slices)).cumsum(0))
    # each slice at its own rank: the slot's rank on slice 0, one less on each slice after
    ranks = torch.tensor([[max(0, r - s) for r in case.ranks] for s in range(len(case.slices))])
    pages, a_rows, b_rows = to_pages(lora_a.to(dtype), lora_b.to(dtype), offsets, gen, align)
    to = {"device": device}
    return (
        x.to(dtype=dtype, **to), pages.to(**to), a_rows.to(**to), b_rows.to(**to), scaling.to(**to),
        token_slots.to(dtype=index_dtype, **to), ranks.to(dtype=index_dtype, **to), offsets,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_lora_shrink_matches_reference(case, dtype, device):
    x, pages, a_rows, _, _, token_slots, ranks, _ = _inputs(case, dtype, device, torch.int32)
    buf = load_triton_op("lora_shrink")(x, pages, a_rows, token_slots, ranks)
    expected = reference.lora_shrink(x.cpu(), pages.cpu(), a_rows.cpu(), token_slots.cpu(), ranks.cpu())
    assert buf.dtype == dtype and buf.shape == expected.shape
    assert_close(buf.cpu(), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_lora_expand_matches_reference(case, dtype, device):
    x, pages, _, b_rows, scaling, token_slots, ranks, offsets = _inputs(case, dtype, device, torch.int64)
    gen = torch.Generator().manual_seed(7)
    # random values beyond each slot's rank in buf too: only the true rank may be read
    buf = torch.randn(len(case.slices), case.tokens, b_rows.shape[2], generator=gen).to(device=device, dtype=dtype)
    y = torch.randn(case.tokens, offsets[-1], generator=gen).to(device=device, dtype=dtype)
    expected = y.cpu().clone()
    reference.lora_expand(expected, buf.cpu(), pages.cpu(), b_rows.cpu(), token_slots.cpu(), ranks.cpu(),
                          scaling.cpu(), offsets)
    before = y.clone()
    load_triton_op("lora_expand")(y, buf, pages, b_rows, token_slots, ranks, scaling, offsets)
    assert_close(y.cpu(), expected)
    if case.pattern == "all-base":
        assert torch.equal(y, before)


@pytest.mark.parametrize("case", [CASES["qkv-mixed-ranks-1-to-128"], CASES["gate-up-prefill-segments"]],
                         ids=["qkv", "gate-up-segments"])
def test_expand_of_one_buf_for_every_slice_equals_that_buf_repeated(case, device):
    """Slices that share one A (a fused-name adapter) are shrunk once: buf [1, T, R] serves every slice."""
    x, pages, _, b_rows, scaling, token_slots, ranks, offsets = _inputs(case, torch.float32, device, torch.int64)
    gen = torch.Generator().manual_seed(11)
    one = torch.randn(1, case.tokens, b_rows.shape[2], generator=gen).to(device)
    y0 = torch.randn(case.tokens, offsets[-1], generator=gen)
    cpu = [t.cpu() for t in (pages, b_rows, token_slots, ranks, scaling)]
    expected = y0.clone()
    reference.lora_expand(expected, one.cpu().expand(len(case.slices), -1, -1).contiguous(), *cpu, offsets)
    assert not torch.allclose(expected, y0)
    got_reference = y0.clone()
    reference.lora_expand(got_reference, one.cpu(), *cpu, offsets)
    assert_close(got_reference, expected)
    y = y0.to(device)
    load_triton_op("lora_expand")(y, one, pages, b_rows, token_slots, ranks, scaling, offsets)
    assert_close(y.cpu(), expected)


def test_shrink_then_expand_with_shared_meta_and_strided_rows(device):
    case = CASES["qkv-mixed-ranks-1-to-128"]
    x, pages, a_rows, b_rows, scaling, token_slots, ranks, offsets = _inputs(case, torch.float32, device, torch.int64)
    meta = LoRAMeta.build(token_slots, len(case.ranks))
    wide = torch.zeros(case.tokens, 2 * offsets[-1], device=device)
    y = wide[:, : offsets[-1]]  # a strided view, as a fused projection's output slice would be
    buf = load_triton_op("lora_shrink")(x, pages, a_rows, token_slots, ranks, meta=meta)
    load_triton_op("lora_expand")(y, buf, pages, b_rows, token_slots, ranks, scaling, offsets, meta=meta)
    expected = torch.zeros(case.tokens, offsets[-1])
    cpu = [t.cpu() for t in (pages, a_rows, b_rows, token_slots, ranks, scaling)]
    ref_buf = reference.lora_shrink(x.cpu(), cpu[0], cpu[1], cpu[3], cpu[4])
    reference.lora_expand(expected, ref_buf, cpu[0], cpu[2], cpu[3], cpu[4], cpu[5], offsets)
    assert_close(y.cpu(), expected)
    assert torch.count_nonzero(wide[:, offsets[-1] :]) == 0


def test_reference_meta_of_other_tokens_over_the_same_tables_keeps_the_gathered_rows():
    """A later step over the same page tables (other tokens, as when sequences finish) reuses the dense rows the
    references gathered, and still gives what a fresh step gives."""
    case = CASES["qkv-mixed-ranks-1-to-128"]
    x, pages, a_rows, b_rows, scaling, token_slots, ranks, offsets = _inputs(case, torch.float32, "cpu", torch.int64)

    def step(slots, meta):
        y = torch.zeros(slots.shape[0], offsets[-1])
        buf = reference.lora_shrink(x[: slots.shape[0]], pages, a_rows, slots, ranks, meta=meta)
        reference.lora_expand(y, buf, pages, b_rows, slots, ranks, scaling, offsets, meta=meta)
        return y

    first = SlotBatch.build(token_slots)
    step(token_slots, first)
    later_slots = token_slots[5:].flip(0)
    later = SlotBatch.build(later_slots, previous=first)
    assert later.gathered is first.gathered and not later.grouped
    assert_close(step(later_slots, later), step(later_slots, SlotBatch.build(later_slots)))


def test_meta_groups_tokens_by_slot_and_refills_in_place():
    meta = LoRAMeta.build(torch.tensor([2, -1, 0, 2, 7, 0]), 3)
    assert meta.slot_counts.tolist() == [2, 0, 2]
    assert meta.slot_starts.tolist() == [0, 2, 2]
    assert meta.sorted_tokens.tolist()[:4] == [2, 5, 0, 3]
    same = meta.sorted_tokens
    meta.fill_(torch.tensor([-1, -1, -1, -1, -1, 1]))
    assert meta.sorted_tokens is same and meta.slot_counts.tolist() == [0, 1, 0]
    assert meta.sorted_tokens.tolist()[meta.slot_starts.tolist()[1]] == 5


def test_shrink_rejects_mismatched_shapes(device):
    x = torch.randn(3, 16, device=device)
    pages = torch.randn(100, device=device)
    a_rows = torch.zeros(1, 2, 4, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="ranks"):
        load_triton_op("lora_shrink")(x, pages, a_rows, torch.zeros(3, dtype=torch.int32, device=device),
                                      torch.ones(2, dtype=torch.int32, device=device))


@pytest.mark.gpu
def test_meta_shrink_and_expand_replay_in_a_cuda_graph():
    case = CASES["qkv-mixed-ranks-1-to-128"]
    x, pages, a_rows, b_rows, scaling, token_slots, ranks, offsets = _inputs(case, torch.bfloat16, "cuda", torch.int32)
    shrink, expand = load_triton_op("lora_shrink"), load_triton_op("lora_expand")
    meta = LoRAMeta.empty(case.tokens, len(case.ranks), "cuda")
    y0 = torch.randn(case.tokens, offsets[-1], device="cuda", dtype=torch.bfloat16)
    y = y0.clone()

    def step():
        meta.fill_(token_slots)
        buf = shrink(x, pages, a_rows, token_slots, ranks, meta=meta)
        expand(y, buf, pages, b_rows, token_slots, ranks, scaling, offsets, meta=meta)

    step()  # warm up: compiles, caches the slice offsets on the device
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    token_slots.copy_(token_slots.flip(0))  # a new batch composition, same shapes
    y.copy_(y0)
    graph.replay()
    expected = y0.cpu().clone()
    cpu = [t.cpu() for t in (pages, a_rows, b_rows, token_slots, ranks, scaling)]
    ref_buf = reference.lora_shrink(x.cpu(), cpu[0], cpu[1], cpu[3], cpu[4])
    reference.lora_expand(expected, ref_buf, cpu[0], cpu[2], cpu[3], cpu[4], cpu[5], offsets)
    assert_close(y.cpu(), expected)
