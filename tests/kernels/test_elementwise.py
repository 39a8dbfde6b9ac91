"""Triton rms_norm, rotary_embedding and silu_and_mul against the references."""

import pytest
import torch

from kernels import reference
from tests.kernels.cases import DTYPES, assert_close
from tests.kernels.conftest import load_triton_op

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "fused-residual"])
@pytest.mark.parametrize("tokens,hidden", [(1, 96), (7, 1000), (3, 4100)], ids=["1x96", "7x1000", "3x4100"])
def test_rms_norm_matches_reference(tokens, hidden, with_residual, dtype, device):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(tokens, hidden, generator=gen) * 3).to(device=device, dtype=dtype)
    weight = torch.randn(hidden, generator=gen).to(device=device, dtype=dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype) if with_residual else None
    got = load_triton_op("rms_norm")(x, weight, 1e-5, residual)
    expected = reference.rms_norm(x.cpu(), weight.cpu(), 1e-5, None if residual is None else residual.cpu())
    if with_residual:
        assert torch.equal(got[1].cpu(), expected[1])
        assert_close(got[0].cpu(), expected[0])
    else:
        assert_close(got.cpu(), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 4, 1), (40, 8, 8), (128, 32, 8)],
                         ids=["d64-gqa4", "d40-mha", "d128-gqa4"])
def test_rotary_embedding_matches_reference(head_dim, heads, kv_heads, dtype, device):
    tokens = 6
    gen = torch.Generator().manual_seed(head_dim)
    cache = reference.rope_cos_sin_cache(head_dim, 256, 500000.0, LLAMA3_SCALING).to(device)
    positions = torch.tensor([0, 1, 63, 64, 200, 255], device=device)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]  # strided views of a fused projection
    q_ref, k_ref = q.cpu().clone(), k.cpu().clone()
    untouched = qkv[:, heads + kv_heads :].clone()
    load_triton_op("rotary_embedding")(positions, q, k, cache)
    reference.rotary_embedding(positions.cpu(), q_ref, k_ref, cache.cpu())
    assert_close(q.cpu(), q_ref)
    assert_close(k.cpu(), k_ref)
    assert torch.equal(qkv[:, heads + kv_heads :], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 37), (5, 1500)], ids=["1x37", "5x1500"])
def test_silu_and_mul_matches_reference(tokens, inter, dtype, device):
    x = (torch.randn(tokens, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(device=device, dtype=dtype)
    out = load_triton_op("silu_and_mul")(x)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    assert_close(out.cpu(), reference.silu_and_mul(x.cpu()))
