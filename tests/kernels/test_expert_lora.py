"""Triton expert_lora (LoRA on the experts of an MoE layer, each row its adapter's own expert) against its
reference and against a dense product computed from the A and B tensors themselves, not through the pages."""

import pytest
import torch

from kernels import reference
from tests.kernels.cases import DTYPES, assert_close
from tests.kernels.conftest import load_triton_op


def _case(*, rows: int, experts: int, ranks: list[int], in_dim: int, out_dim: int, base_rows: int, dtype, device,
          seed: int, slices: int = 1):
    """Random adapters laid out row by row in a flat page memory (with gaps), their page tables, and each row's
    slot and expert; returns the op's arguments and the A [U, E, R, in], B [U, E, R, out] they hold. B's rows
    are cut into `slices` equal output slices, each with its own page table (gate_up's gate and up)."""
    gen = torch.Generator().manual_seed(seed)
    used, max_rank = len(ranks), max(ranks)
    a = torch.randn(used, experts, max_rank, in_dim, generator=gen) / in_dim**0.5
    b = torch.randn(used, experts, max_rank, out_dim, generator=gen)
    rank_mask = (torch.arange(max_rank)[None, :] < torch.tensor(ranks)[:, None]).float()  # [U, R]
    a, b = a * rank_mask[:, None, :, None], b * rank_mask[:, None, :, None]
    pages, at = [torch.zeros(3)], 3  # offset 0 .. 2: padding, so no row starts at 0
    width = out_dim // slices
    a_rows = torch.zeros(used, experts, max_rank, dtype=torch.int64)
    b_rows = torch.zeros(slices, used, experts, max_rank, dtype=torch.int64)
    for u in range(used):
        for e in range(experts):
            for j in range(ranks[u]):
                parts = [(a_rows[u, e], j, a[u, e, j])]
                parts += [(b_rows[s, u, e], j, b[u, e, j, s * width : (s + 1) * width]) for s in range(slices)]
                for table, index, row in parts:
                    table[index] = at
                    pages += [row, torch.zeros(1)]  # one value of gap after each row
                    at += row.shape[0] + 1
    pages = torch.cat(pages).to(device=device, dtype=dtype)
    slots = torch.randint(0, used, (rows,), generator=gen)
    slots[torch.randperm(rows, generator=gen)[:base_rows]] = -1
    row_experts = torch.randint(0, experts, (rows,), generator=gen).sort().values  # expert-sorted, as the layer
    x = torch.randn(rows, in_dim, generator=gen).to(device=device, dtype=dtype)
    y = torch.randn(rows, out_dim, generator=gen).to(device=device, dtype=dtype)
    scaling = torch.rand(used, generator=gen) + 0.5
    args = (y, x, pages, a_rows.to(device), b_rows.to(device), slots.to(device=device, dtype=torch.int32),
            row_experts.to(device), torch.tensor(ranks, dtype=torch.int32, device=device), scaling.to(device),
            tuple(range(0, out_dim + 1, width)))
    return args, a, b


def _dense(args, a, b) -> torch.Tensor:
    """y + scaling * (x @ A[slot, expert].T) @ B[slot, expert] per row, in float32 from the tensors themselves."""
    y, x, _, _, _, slots, row_experts, _, scaling = (t.cpu() for t in args[:-1])
    out = y.float().clone()
    for n in range(x.shape[0]):
        slot, expert = int(slots[n]), int(row_experts[n])
        if slot >= 0:
            out[n] += scaling[slot] * (a[slot, expert] @ x[n].float()) @ b[slot, expert]
    return out.to(y.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,experts,ranks,in_dim,out_dim,base_rows,slices", [
    (1, 3, [4], 37, 50, 0, 1),  # a single row
    (23, 5, [2, 0, 7], 64, 96, 5, 2),  # an adapter that leaves the module alone, base rows, gate and up slices
    (17, 4, [1, 3], 130, 140, 0, 2),  # several input and output blocks, odd widths
    (9, 2, [5, 4], 8, 3, 9, 1),  # every row the base model's: nothing changes
    (150, 2, [3, 0, 5], 24, 40, 20, 2),  # many rows per (adapter, expert): the reference goes pair by pair
], ids=["1-row", "mixed-ranks-and-base", "odd-widths", "all-base", "long-runs"])
def test_expert_lora_matches_reference_and_dense(rows, experts, ranks, in_dim, out_dim, base_rows, slices, dtype,
                                                 device):
    args, a, b = _case(rows=rows, experts=experts, ranks=ranks, in_dim=in_dim, out_dim=out_dim,
                       base_rows=base_rows, dtype=dtype, device=device, seed=rows + in_dim, slices=slices)
    before = args[0].clone()
    expected = _dense(args, a, b)
    got = args[0]
    load_triton_op("expert_lora")(*args)
    ref_args = (before.cpu().clone(), *(t.cpu() for t in args[1:-1]), args[-1])
    reference.expert_lora(*ref_args)
    assert_close(got.cpu(), expected)
    assert_close(ref_args[0], expected)
    if base_rows == rows:
        assert torch.equal(got.cpu(), before.cpu())


def test_expert_lora_refuses_mismatched_tables(device):
    args, _, _ = _case(rows=4, experts=3, ranks=[2], in_dim=8, out_dim=5, base_rows=0, dtype=torch.float32,
                       device=device, seed=1)
    y, x, pages, a_rows, b_rows, slots, row_experts, ranks, scaling, offsets = args
    op = load_triton_op("expert_lora")
    with pytest.raises(ValueError, match="b_rows"):
        op(y, x, pages, a_rows, b_rows[:, :, :2], slots, row_experts, ranks, scaling, offsets)
    with pytest.raises(ValueError, match="row_experts"):
        op(y, x, pages, a_rows, b_rows, slots, row_experts[:3], ranks, scaling, offsets)
    with pytest.raises(ValueError, match="slice_offsets"):
        op(y, x, pages, a_rows, b_rows, slots, row_experts, ranks, scaling, (0, 4))
