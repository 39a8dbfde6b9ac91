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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 37), (5, 1500), (3, 2)], ids=["1x37", "5x1500", "3x2"])
def test_gelu_tanh_and_mul_matches_reference(tokens, inter, dtype, device):
    x = (torch.randn(tokens, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(device=device, dtype=dtype)
    x[0, 0], x[-1, inter - 1] = 30.0, -30.0  # where tanh saturates
    out = load_triton_op("gelu_tanh_and_mul")(x)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    assert_close(out.cpu(), reference.gelu_tanh_and_mul(x.cpu()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [24, 80, 128], ids=lambda d: f"d{d}")
def test_rms_norm_per_head_matches_reference(head_dim, dtype, device):
    """Qwen3/Gemma 3's q/k norm: each head's vector normalized, x viewed as [T * heads, head_dim]."""
    tokens, heads = 5, 3
    gen = torch.Generator().manual_seed(head_dim)
    x = (torch.randn(tokens, heads * head_dim, generator=gen) * 3).to(device=device, dtype=dtype)
    weight = torch.randn(head_dim, generator=gen).to(device=device, dtype=dtype)
    got = load_triton_op("rms_norm")(x.view(tokens * heads, head_dim), weight, 1e-6)
    assert_close(got.cpu(), reference.rms_norm(x.cpu().view(tokens * heads, head_dim), weight.cpu(), 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 48), (32, 24), (40, 40), (128, 96)],
                         ids=["48-of-64", "24-of-32", "40-of-40", "96-of-128"])
def test_partial_rotary_embedding_matches_reference(head_dim, rotary_dim, dtype, device):
    tokens, heads, kv_heads = 6, 4, 2
    gen = torch.Generator().manual_seed(rotary_dim)
    cache = reference.rope_cos_sin_cache(head_dim, 256, 10000.0, rotary_dim=rotary_dim).to(device)
    positions = torch.tensor([0, 1, 63, 64, 200, 255], device=device)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    before = qkv.clone()
    q_ref, k_ref = q.cpu().clone(), k.cpu().clone()
    load_triton_op("rotary_embedding")(positions, q, k, cache)
    reference.rotary_embedding(positions.cpu(), q_ref, k_ref, cache.cpu())
    assert_close(q.cpu(), q_ref)
    assert_close(k.cpu(), k_ref)
    assert torch.equal(qkv[..., rotary_dim:], before[..., rotary_dim:])  # the pass-through dims
    assert torch.equal(qkv[:, heads + kv_heads :], before[:, heads + kv_heads :])  # v
