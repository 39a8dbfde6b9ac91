"""The plain-PyTorch references against naive loops and transformers' own Llama modules."""

import importlib
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

import kernels
from kernels import reference
from tests.kernels.paged_lora import to_pages

ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
}


def _hf_rotary(head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> LlamaRotaryEmbedding:
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    config = LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_parameters=params,
    )
    return LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("scaling", list(ROPE_CASES.values()), ids=list(ROPE_CASES))
def test_rope_cache_matches_transformers_exactly(scaling):
    head_dim, max_positions, theta = 64, 4096, 500000.0
    cos, sin = _hf_rotary(head_dim, max_positions, theta, scaling)(torch.zeros(1), torch.arange(max_positions)[None])
    cache = reference.rope_cos_sin_cache(head_dim, max_positions, theta, scaling)
    assert cache.shape == (max_positions, head_dim)
    assert torch.equal(cache[:, : head_dim // 2], cos[0, :, : head_dim // 2])
    assert torch.equal(cache[:, head_dim // 2 :], sin[0, :, : head_dim // 2])


def test_rope_cache_rejects_unknown_scaling():
    with pytest.raises(ValueError, match="yarn"):
        reference.rope_cos_sin_cache(64, 16, 10000.0, {"rope_type": "yarn", "factor": 2.0})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotary_embedding_matches_transformers(dtype):
    head_dim, heads, kv_heads, tokens = 32, 4, 2, 7
    scaling = ROPE_CASES["llama3"]
    rotary = _hf_rotary(head_dim, 512, 500000.0, scaling)
    positions = torch.tensor([0, 5, 6, 300, 301, 511, 2])
    q = torch.randn(tokens, heads, head_dim).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim).to(dtype)
    cos, sin = rotary(q, positions[None])  # [1, T, D]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cache = reference.rope_cos_sin_cache(head_dim, 512, 500000.0, scaling)
    reference.rotary_embedding(positions, q, k, cache)
    assert torch.equal(q, q_hf[0].transpose(0, 1))
    assert torch.equal(k, k_hf[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_llama_rms_norm(dtype, with_residual):
    hidden = 96
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden))
    x = torch.randn(5, hidden).to(dtype)
    residual = torch.randn(5, hidden).to(dtype) if with_residual else None
    got = reference.rms_norm(x, norm.weight.detach(), 1e-5, residual)
    if with_residual:
        out, new_residual = got
        assert torch.equal(new_residual, x + residual)
        assert torch.equal(out, norm(x + residual).detach())
    else:
        assert torch.equal(got, norm(x).detach())


def test_silu_and_mul():
    x = torch.randn(3, 2 * 37)
    assert torch.equal(reference.silu_and_mul(x), F.silu(x[:, :37]) * x[:, 37:])


def _lora_case(tokens=11, in_dim=24, slots=5, max_rank=8, slices=(6, 10, 4)):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, in_dim, generator=gen)
    lora_a = torch.randn(len(slices), slots, max_rank, in_dim, generator=gen)
    lora_b = torch.randn(slots, sum(slices), max_rank, generator=gen)
    own = [max_rank, 1, 0, 3, max_rank - 1][:slots]
    ranks = torch.tensor([[max(0, r - s) for r in own] for s in range(len(slices))])  # [S, U]: each slice its own
    token_slots = torch.tensor([0, -1, 3, 1, 1, -1, 4, 0, 2, 3, 4][:tokens])
    scaling = torch.rand(len(slices), slots, generator=gen)
    offsets = tuple(int(v) for v in torch.tensor((0, *slices)).cumsum(0))
    return x, lora_a, lora_b, ranks, token_slots, scaling, offsets


def test_lora_shrink_and_expand_match_naive_loops():
    x, lora_a, lora_b, ranks, token_slots, scaling, offsets = _lora_case()
    pages, a_rows, b_rows = to_pages(lora_a, lora_b, offsets, torch.Generator().manual_seed(1))
    buf = reference.lora_shrink(x, pages, a_rows, token_slots, ranks)
    y0 = torch.randn(x.shape[0], offsets[-1])
    y = y0.clone()
    reference.lora_expand(y, buf, pages, b_rows, token_slots, ranks, scaling, offsets)
    expect_buf = torch.zeros_like(buf)
    expect_y = y0.clone()
    for t in range(x.shape[0]):
        a = int(token_slots[t])
        if a < 0:
            continue
        for s in range(len(offsets) - 1):
            r = int(ranks[s, a])
            for j in range(r):
                expect_buf[s, t, j] = sum(float(x[t, i]) * float(lora_a[s, a, j, i]) for i in range(x.shape[1]))
            for o in range(offsets[s], offsets[s + 1]):
                dot = sum(float(expect_buf[s, t, j]) * float(lora_b[a, o, j]) for j in range(r))
                expect_y[t, o] += float(scaling[s, a]) * dot
    torch.testing.assert_close(buf, expect_buf)
    torch.testing.assert_close(y, expect_y)


def _paged_case(seq_lens, heads=4, kv_heads=2, head_dim=8, block_size=4, num_blocks=40):
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(seq_lens):
        count = -(-n // block_size)
        block_tables[b, :count] = perm[used : used + count].int()
        used += count
    return k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32)


def _naive_attention(q_vec, k_cache, v_cache, table, upto, kv_head, scale):
    block_size = k_cache.shape[1]
    keys = torch.stack([k_cache[table[j // block_size], j % block_size, kv_head] for j in range(upto)])
    values = torch.stack([v_cache[table[j // block_size], j % block_size, kv_head] for j in range(upto)])
    weights = torch.softmax(keys @ q_vec * scale, 0)
    return weights @ values


def test_paged_attention_decode_matches_naive_loop():
    heads, head_dim = 4, 8
    k_cache, v_cache, block_tables, context_lens = _paged_case([1, 6, 9, 4])
    q = torch.randn(4, heads, head_dim)
    scale = 1 / math.sqrt(head_dim)
    out = reference.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
    for b in range(4):
        for h in range(heads):
            expect = _naive_attention(
                q[b, h], k_cache, v_cache, block_tables[b].tolist(), int(context_lens[b]), h // 2, scale
            )
            torch.testing.assert_close(out[b, h], expect)


def test_paged_attention_prefill_matches_naive_loop():
    heads, head_dim = 4, 8
    seq_lens, q_lens = [5, 9, 3], [5, 2, 1]
    k_cache, v_cache, block_tables, context_lens = _paged_case(seq_lens)
    cu = torch.tensor([0, *q_lens]).cumsum(0).int()
    q = torch.randn(sum(q_lens), heads, head_dim)
    scale = 0.3
    out = reference.paged_attention_prefill(q, k_cache, v_cache, cu, block_tables, context_lens, scale)
    for b, (n, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        for i in range(ql):
            row = int(cu[b]) + i
            for h in range(heads):
                expect = _naive_attention(q[row, h], k_cache, v_cache, block_tables[b].tolist(), n - ql + i + 1, h // 2, scale)
                torch.testing.assert_close(out[row, h], expect)


def test_store_kv_skips_negative_slots():
    k_cache = torch.zeros(3, 4, 2, 5)
    v_cache = torch.zeros(3, 4, 2, 5)
    k, v = torch.randn(3, 2, 5), torch.randn(3, 2, 5)
    reference.store_kv(k, v, k_cache, v_cache, torch.tensor([9, -1, 0]))
    assert torch.equal(k_cache[2, 1], k[0]) and torch.equal(v_cache[2, 1], v[0])
    assert torch.equal(k_cache[0, 0], k[2]) and torch.equal(v_cache[0, 0], v[2])
    assert int((k_cache != 0).sum()) == 2 * 2 * 5


def test_dispatch_runs_the_reference_on_cpu():
    x = torch.randn(2, 2 * 6)
    assert kernels.backend_for(x) == "reference"
    assert callable(kernels.lora_shrink) and callable(kernels.paged_attention_decode)
    assert torch.equal(kernels.silu_and_mul(x), reference.silu_and_mul(x))


def test_cuda_tensor_without_triton_raises_instead_of_falling_back(monkeypatch):
    monkeypatch.setattr(kernels, "TRITON_IMPORT_ERROR", ImportError("No module named 'triton'"))
    with pytest.raises(RuntimeError, match="Triton"):
        kernels.backend_for(SimpleNamespace(is_cuda=True))


def test_op_names_stay_dispatch_functions_after_submodule_imports():
    importlib.import_module("kernels.lora_shrink")
    importlib.import_module("kernels.rms_norm")
    assert kernels.lora_shrink.__module__ == "kernels" and kernels.rms_norm.__module__ == "kernels"
    assert "x[t] @ pages[a_rows" in kernels.lora_shrink.__doc__
