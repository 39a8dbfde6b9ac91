"""Triton grouped_matmul (the experts of an MoE layer) against its reference and against a dense per-row product."""

import pytest
import torch

from kernels import reference
from tests.kernels.cases import DTYPES, assert_close
from tests.kernels.conftest import load_triton_op


def _offsets(counts: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts,out_dim,in_dim", [
    ([1], 37, 50),  # a single token, one expert
    ([0, 3, 0, 17, 1], 96, 64),  # experts with no rows, one spanning two row blocks
    ([5, 0, 2], 130, 100),  # non-power-of-two widths, several column and reduction blocks
    ([0, 0, 4], 8, 3),  # narrower than a block in both dims
    ([16, 0, 33, 16], 40, 24),  # row counts at and past block boundaries: every bound block is used
], ids=["1-token", "empty-experts", "odd-widths", "tiny", "full-blocks"])
def test_grouped_matmul_matches_reference(counts, out_dim, in_dim, dtype, device):
    gen = torch.Generator().manual_seed(out_dim + in_dim)
    rows = sum(counts)
    x = torch.randn(rows, in_dim, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(len(counts), out_dim, in_dim, generator=gen) / in_dim**0.5).to(device=device, dtype=dtype)
    offsets = _offsets(counts, device)
    got = load_triton_op("grouped_matmul")(x, weight, offsets)
    expected = reference.grouped_matmul(x.cpu(), weight.cpu(), offsets.cpu())
    assert got.shape == (rows, out_dim) and got.dtype == dtype
    assert_close(got.cpu(), expected)
    experts = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))  # each row's expert
    dense = torch.einsum("ni,noi->no", x.cpu().float(), weight.cpu().float()[experts]).to(dtype)
    assert_close(expected, dense)


def test_grouped_matmul_of_no_rows_and_bad_offsets(device):
    op = load_triton_op("grouped_matmul")
    weight = torch.randn(3, 8, 5, device=device)
    assert op(torch.empty(0, 5, device=device), weight, _offsets([0, 0, 0], device)).shape == (0, 8)
    with pytest.raises(ValueError, match="expert_offsets"):
        op(torch.randn(4, 5, device=device), weight, _offsets([1, 1], device))
    with pytest.raises(ValueError, match="columns"):
        op(torch.randn(4, 6, device=device), weight, _offsets([1, 1, 2], device))
    if device == "cpu":  # on CUDA the launcher reads nothing back to check it
        with pytest.raises(ValueError, match="end at"):
            op(torch.randn(4, 5, device=device), weight, _offsets([1, 1, 1], device))


def test_grouped_rows_gives_the_same_rows_without_torchs_grouped_mm(monkeypatch):
    """The references' grouped product has two paths: torch._grouped_mm (private API, CPU float32 on this torch) and
    a matmul per group (any other torch or device); both give the per-row product."""
    from kernels import grouped_rows as module

    gen = torch.Generator().manual_seed(7)
    counts = [0, 5, 3, 0, 9]
    x = torch.randn(sum(counts), 12, generator=gen)
    weight_t = torch.randn(len(counts), 12, 8, generator=gen)
    bounds = [0, *torch.tensor(counts).cumsum(0).tolist()]
    experts = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    dense = torch.einsum("ni,nio->no", x, weight_t[experts])
    assert_close(module.grouped_rows(x, weight_t, bounds), dense)
    monkeypatch.setattr(module, "_GROUPED_MM_WORKS", {"cpu": False})  # as on a torch without the CPU kernel
    assert_close(module.grouped_rows(x, weight_t, bounds), dense)
    monkeypatch.setattr(module, "_GROUPED_MM_WORKS", {})
    monkeypatch.delattr(torch, "_grouped_mm")  # as on a torch without the private op at all
    assert_close(module.grouped_rows(x, weight_t, bounds), dense)


FP8_CASES = pytest.mark.parametrize("counts,out_dim,in_dim,group_k", [
    ([1], 200, 300, 128),  # a single token; neither dim a multiple of 128: partial blocks
    ([0, 3, 0, 17, 1], 96, 256, 128),  # experts with no rows, whole column blocks
    ([5, 0, 2], 40, 70, 70),  # per-channel: one group over every column
], ids=["1-token-odd", "empty-experts", "per-channel"])


def _fp8_experts(counts, out_dim, in_dim, group_k):
    """(x [N, in] float32, weight [E, out, in] fp8, scale [E, out, groups] float32): an fp8 checkpoint's experts."""
    gen = torch.Generator().manual_seed(out_dim + in_dim)
    experts, groups = len(counts), -(-in_dim // group_k)
    x = torch.randn(sum(counts), in_dim, generator=gen)
    weight = (torch.randn(experts, out_dim, in_dim, generator=gen) * 100).clamp(-448, 448).to(reference.FP8)
    scale = torch.logspace(-4, -2, experts * out_dim * groups)[torch.randperm(experts * out_dim * groups,
                                                                              generator=gen)]
    return x, weight, scale.view(experts, out_dim, groups)


@pytest.mark.parametrize("dtype", DTYPES)
@FP8_CASES
def test_grouped_matmul_of_fp8_experts_matches_reference(counts, out_dim, in_dim, group_k, dtype, device):
    """An fp8 checkpoint's experts: fp8 weights, a float32 scale per row and group of columns."""
    x, weight, scale = _fp8_experts(counts, out_dim, in_dim, group_k)
    x = x.to(device=device, dtype=dtype)
    offsets = _offsets(counts, device)
    got = load_triton_op("grouped_matmul")(x, weight.to(device), offsets, scale.to(device), group_k)
    expected = reference.grouped_matmul(x.cpu(), weight, offsets.cpu(), scale, group_k)
    assert got.shape == (sum(counts), out_dim) and got.dtype == dtype
    assert_close(got.cpu(), expected)
    with pytest.raises(ValueError, match="weight_scale"):
        load_triton_op("grouped_matmul")(x, weight.to(device), offsets, None, group_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@FP8_CASES
def test_the_fp8_experts_reference_is_the_dense_product(counts, out_dim, in_dim, group_k, dtype):
    """The reference (CPU only) against each row times its expert's dequantized weight. Both sum in float32, in
    different orders (the reference's grouped product, torch._grouped_mm or a matmul per expert, against einsum),
    ~1e-7 apart, and round once to dtype: a sum that close to a midpoint between two dtype values rounds to either,
    one unit in the last place apart, up to eps(dtype) relative. On the H200 ([empty-experts-fp16], a matmul per
    expert) element (18, 40), 0.7790523 in float64, 4e-7 below fp16's midpoint 0.7790527, rounded to 0.7792969
    one way and 0.7788086 the other: 4.9e-4 apart, past the 1e-4 that was allowed; on CPU (torch 2.13, whose
    torch._grouped_mm serves it) the same element and one more round apart. So the tolerance is one rounding
    step of dtype, not 1e-4."""
    x, weight, scale = _fp8_experts(counts, out_dim, in_dim, group_k)
    x = x.to(dtype)
    experts = len(counts)
    expected = reference.grouped_matmul(x, weight, _offsets(counts, "cpu"), scale, group_k)
    dense = weight.float() * scale.repeat_interleave(group_k, dim=2)[:, :, :in_dim]  # [E, out, in]
    rows = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts))
    product = torch.einsum("ni,noi->no", x.float(), dense[rows]).to(dtype)  # [N, out]
    one_step = max(1e-4, torch.finfo(dtype).eps)  # float32: its summation orders, 1e-4 as before
    torch.testing.assert_close(expected.float(), product.float(), atol=1e-4, rtol=one_step)
