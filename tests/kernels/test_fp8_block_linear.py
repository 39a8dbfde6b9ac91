"""The fp8 checkpoints' projection: kernels/fp8_block_linear.py against kernels.reference.fp8_block_linear, on
block scales ([128, 128] blocks, the weight_block_size checkpoints) and per-channel scales, on shapes that are
not multiples of a block, and a single token."""

import pytest
import torch

from kernels import reference
from kernels.launch import cdiv
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


SPLITS = {  # (tokens, out, in, group_k, config): split-K over K tiles that end inside the last group or past it
    "3-tiles-in-2-splits": (3, 200, 333, 128, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2}),
    "more-splits-than-tiles": (19, 130, 300, 128, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 9}),
    "per-channel-rows-of-32": (37, 96, 300, 300, {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 3}),
}


@pytest.mark.parametrize("case", list(SPLITS.values()), ids=list(SPLITS))
def test_split_k_matches_reference(case, device):
    tokens, out_dim, in_dim, group_k, config = case
    x, weight, scale = _case(tokens, out_dim, in_dim, group_k, device, torch.float32)
    got = load_triton_op("fp8_block_linear")(x, weight, scale, group_k, config={**config, "num_warps": 4})
    assert_close(got.cpu(), reference.fp8_block_linear(x.cpu(), weight.cpu(), scale.cpu(), group_k))


@pytest.mark.parametrize("projection", ["qkv", "o", "gate_up", "down"])
def test_at_decode_shapes_a_program_reads_no_more_x_than_weights(projection):
    """Llama-3-8B on 132 SMs at 64 tokens: x at most the weights' bytes a step (programs of 16 columns would each
    read a 64-row tile of x, 16 KB, for 2 KB of weights: 8x), and split-K keeps all but a few SMs busy."""
    import importlib

    in_dim, out_dim = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}[projection]
    config = importlib.import_module("kernels.fp8_block_linear")._config(64, out_dim, in_dim, 128, 132)
    assert config["BLOCK_M"] * config["BLOCK_K"] * 2 <= config["BLOCK_K"] * config["BLOCK_N"], config
    programs = cdiv(64, config["BLOCK_M"]) * cdiv(out_dim, config["BLOCK_N"]) * config["SPLIT_K"]
    assert programs >= 128, config
