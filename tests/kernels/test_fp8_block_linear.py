"""The fp8 checkpoints' projection: kernels/fp8_block_linear.py against kernels.reference.fp8_block_linear, on
block scales ([128, 128] blocks, the weight_block_size checkpoints) and per-channel scales, on shapes that are
not multiples of a block, and a single token."""

import pytest
import torch

from kernels import reference
from kernels.reference import FP8
from tests.kernels.cases import DTYPES, assert_close
from tests.kernels.conftest import load_triton_op


def _case(tokens: int, out_dim: int, in_dim: int, group_k: int, device: str, dtype: torch.dtype):
    """x, an fp8 weight and its scales: block scales [cdiv(out, 128), cdiv(in, group_k)] of very different
    sizes, repeated over each block's 128 rows, as the loader holds them."""
    gen = torch.Generator().manual_seed(out_dim * 7 + in_dim)
    x = torch.randn(tokens, in_dim, generator=gen)
    weight = (torch.randn(out_dim, in_dim, generator=gen) * 100).clamp(-448, 448).to(FP8)
    groups = -(-in_dim // group_k)
    blocks = torch.logspace(-4, -2, (-(-out_dim // 128)) * groups)[torch.randperm((-(-out_dim // 128)) * groups,
                                                                                generator=gen)]
    scale = blocks.view(-1, groups).repeat_interleave(128, dim=0)[:out_dim].contiguous()  # [out, groups]
    return x.to(device=device, dtype=dtype), weight.to(device), scale.to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,out_dim,in_dim,group_k", [
    (1, 200, 333, 128),  # a single token; neither dim a multiple of a block: partial last blocks both ways
    (37, 384, 256, 128),  # whole blocks, several row tiles
    (5, 96, 72, 128),  # narrower than one block in both dims
    (19, 130, 300, 300),  # per-channel: one group over every column
], ids=["1-token-odd", "whole-blocks", "sub-block", "per-channel"])
def test_fp8_block_linear_matches_reference(tokens, out_dim, in_dim, group_k, dtype, device):
    x, weight, scale = _case(tokens, out_dim, in_dim, group_k, device, dtype)
    got = load_triton_op("fp8_block_linear")(x, weight, scale, group_k)
    expected = reference.fp8_block_linear(x.cpu(), weight.cpu(), scale.cpu(), group_k)
    assert got.shape == (tokens, out_dim) and got.dtype == dtype
    assert_close(got.cpu(), expected)
    # the reference is the product with the dequantized weight, each column group at its own block's scale
    dense = torch.empty(out_dim, in_dim)
    for o in range(out_dim):
        for g in range(0, in_dim, group_k):
            dense[o, g : g + group_k] = weight[o, g : g + group_k].cpu().float() * scale[o, g // group_k].cpu()
    torch.testing.assert_close(expected.float(), (x.cpu().float() @ dense.t()).to(dtype).float(), atol=1e-5,
                               rtol=1e-5)


def test_fp8_block_linear_refuses_bad_scales(device):
    op = load_triton_op("fp8_block_linear")
    x, weight, scale = _case(3, 200, 333, 128, device, torch.float32)
    with pytest.raises(ValueError, match=r"weight_scale: expected shape \(200, 3\)"):
        op(x, weight, scale[:, :2].contiguous(), 128)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        op(x, weight.float(), scale, 128)
    with pytest.raises(ValueError, match="multiple of 16"):
        op(x, weight, scale, 100)
    assert op(x[:0], weight, scale, 128).shape == (0, 200)
