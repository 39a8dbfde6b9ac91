"""The fused LoRA kernel (kernels/lora_delta.py: shrink and expand of every slice in one launch) against its
reference twin (interpreted on CPU, native with CUDA), on the shapes of tests/kernels/test_lora.py and on the
layout the engine hands it: views of one static table, slots past the step's, a meta over more tokens."""

import pytest
import torch

from kernels import LoRAMeta, reference
from kernels.lora_meta import BLOCK_M, max_blocks
from tests.kernels.cases import DTYPES, assert_close
from tests.kernels.conftest import load_triton_op
from tests.kernels.test_lora import CASES, LoRACase, _inputs

DELTA_CASES = {**CASES, "non-power-of-two-hidden-qkv": LoRACase(19, 100, (4, 16, 2), (100, 20, 20), "mixed"),
               "one-slot-more-than-a-block": LoRACase(2 * BLOCK_M + 3, 40, (8,), (24, 24), "mixed")}


def _reference(y, x, pages, a_rows, b_rows, token_slots, ranks, scaling, offsets) -> torch.Tensor:
    expected = y.cpu().clone()
    reference.lora_delta(expected, x.cpu(), pages.cpu(), a_rows.cpu(), b_rows.cpu(), token_slots.cpu(), ranks.cpu(),
                         scaling.cpu(), offsets)
    return expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(DELTA_CASES.values()), ids=list(DELTA_CASES))
def test_lora_delta_matches_reference(case, dtype, device):
    x, pages, a_rows, b_rows, scaling, token_slots, ranks, offsets = _inputs(case, dtype, device, torch.int32)
    y = torch.randn(case.tokens, offsets[-1], generator=torch.Generator().manual_seed(3)).to(device=device, dtype=dtype)
    expected = _reference(y, x, pages, a_rows, b_rows, token_slots, ranks, scaling, offsets)
    before = y.clone()
    meta = LoRAMeta.build(token_slots, len(case.ranks))
    load_triton_op("lora_delta")(y, x, pages, a_rows, b_rows, token_slots, ranks, scaling, offsets, meta=meta)
    assert_close(y.cpu(), expected)
    if case.pattern == "all-base":
        assert torch.equal(y, before)
    else:
        assert not torch.equal(y, before)


def test_slices_reading_one_a_as_a_fused_name_adapter_does(device):
    """Every slice reads slice 0's A rows (a fused-name adapter): a [1, U, R] table, or the rows repeated per
    slice, as the engine's static tables hold them, give the reference's delta."""
    case = CASES["qkv-mixed-ranks-1-to-128"]
    x, pages, a_rows, b_rows, scaling, token_slots, _, offsets = _inputs(case, torch.float32, device, torch.int32)
    ranks = torch.tensor(case.ranks, dtype=torch.int32, device=device).expand(3, -1).contiguous()  # one rank per A
    y0 = torch.randn(case.tokens, offsets[-1], generator=torch.Generator().manual_seed(5)).to(device)
    expected = _reference(y0, x, pages, a_rows[:1], b_rows, token_slots, ranks, scaling, offsets)
    meta = LoRAMeta.build(token_slots, len(case.ranks))
    for shared in (a_rows[:1], a_rows[:1].expand(3, -1, -1).contiguous()):
        y = y0.clone()
        load_triton_op("lora_delta")(y, x, pages, shared, b_rows, token_slots, ranks, scaling, offsets, meta=meta)
        assert_close(y.cpu(), expected)


def test_views_of_a_static_table_with_spare_slots_and_a_meta_over_more_tokens(device):
    """The engine's layout: a_rows and b_rows views of one [S, 2, U', R] table (U' > U: slots no token uses hold
    junk), ranks and scaling views with a spare column, y a strided view, and a meta sized for more tokens
    (the rest count as the base model's)."""
    case = CASES["gate-up-prefill-segments"]
    x, pages, a_rows, b_rows, scaling, token_slots, ranks, offsets = _inputs(case, torch.float32, device, torch.int32)
    slices, used, rank = a_rows.shape
    table = torch.randint(0, pages.numel() - 200, (slices, 2, used + 3, rank), device=device)  # junk slots
    table[:, 0, :used], table[:, 1, :used] = a_rows, b_rows
    wide_ranks = torch.full((slices, used + 3), 9, dtype=torch.int32, device=device)
    wide_ranks[:, :used] = ranks
    wide_scaling = torch.ones(slices, used + 3, device=device)
    wide_scaling[:, :used] = scaling
    wide = torch.zeros(case.tokens, 2 * offsets[-1], device=device)
    y = wide[:, : offsets[-1]]
    meta = LoRAMeta.empty(case.tokens + 40, used + 3, device)
    meta.fill_(token_slots)
    load_triton_op("lora_delta")(y, x, pages, table[:, 0], table[:, 1], token_slots, wide_ranks, wide_scaling,
                                 offsets, meta=meta)
    expected = _reference(torch.zeros(case.tokens, offsets[-1]), x, pages, a_rows, b_rows, token_slots, ranks,
                          scaling, offsets)
    assert_close(y.cpu(), expected)
    assert torch.count_nonzero(wide[:, offsets[-1] :]) == 0


def test_meta_cuts_each_slots_tokens_into_blocks_refilled_in_place():
    slots = torch.tensor([2] * (BLOCK_M + 1) + [-1, 0, 7])  # slot 2: two blocks; 7 is past the slots: base
    meta = LoRAMeta.empty(40, 3, "cpu")
    storage = (meta.block_slots.data_ptr(), meta.sorted_tokens.data_ptr())
    meta.fill_(slots)
    assert meta.slot_counts.tolist() == [1, 0, BLOCK_M + 1]
    assert meta.block_slots.tolist() == [0, 2, 2] + [-1] * (max_blocks(40, 3) - 3)
    assert meta.block_offsets.tolist()[:3] == [0, 0, BLOCK_M]
    on_host = LoRAMeta.empty(40, 3, "cpu").fill_host_(slots.tolist())  # grouped on the host: the same
    assert torch.equal(on_host.packed, meta.packed)
    meta.fill_(torch.full((5,), -1))  # an all-base step
    assert (meta.block_slots == -1).all() and meta.slot_counts.tolist() == [0, 0, 0]
    assert (meta.block_slots.data_ptr(), meta.sorted_tokens.data_ptr()) == storage
    gen = torch.Generator().manual_seed(2)
    for tokens in (1, 17, 40):  # random steps: host and device grouping agree
        slots = torch.randint(-1, 4, (tokens,), generator=gen)
        assert torch.equal(meta.fill_(slots).packed, on_host.fill_host_(slots.tolist()).packed)


def test_lora_delta_rejects_a_meta_of_other_slots(device):
    case = CASES["single-token"]
    x, pages, a_rows, b_rows, scaling, token_slots, ranks, offsets = _inputs(case, torch.float32, device, torch.int32)
    with pytest.raises(ValueError, match="do not fit"):
        load_triton_op("lora_delta")(torch.zeros(1, offsets[-1], device=device), x, pages, a_rows, b_rows,
                                     token_slots, ranks, scaling, offsets, meta=LoRAMeta.build(token_slots, 5))


@pytest.mark.gpu
def test_lora_delta_replays_in_a_cuda_graph_with_another_mix_of_adapters():
    case = CASES["qkv-mixed-ranks-1-to-128"]
    x, pages, a_rows, b_rows, scaling, token_slots, ranks, offsets = _inputs(case, torch.bfloat16, "cuda", torch.int32)
    delta = load_triton_op("lora_delta")
    meta = LoRAMeta.empty(case.tokens, len(case.ranks), "cuda")
    y0 = torch.randn(case.tokens, offsets[-1], device="cuda", dtype=torch.bfloat16)
    y = y0.clone()

    def step():
        meta.fill_(token_slots)
        delta(y, x, pages, a_rows, b_rows, token_slots, ranks, scaling, offsets, meta=meta)

    step()  # warm up: compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    token_slots.copy_(token_slots.flip(0))  # a new batch composition, same shapes
    y.copy_(y0)
    graph.replay()
    assert_close(y.cpu(), _reference(y0, x, pages, a_rows, b_rows, token_slots, ranks, scaling, offsets))
