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


ROPE_MORE_CASES = {  # rope types whose table transformers' LlamaRotaryEmbedding builds (max_position_embeddings 256)
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-untruncated-betas": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                               "truncate": False, "beta_fast": 16, "beta_slow": 2},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                    "mscale_all_dim": 0.5},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                              "attention_factor": 0.9},
    "yarn-legacy-type-key": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
}


@pytest.mark.parametrize("scaling", list(ROPE_MORE_CASES.values()), ids=list(ROPE_MORE_CASES))
@pytest.mark.parametrize("head_dim", [64, 40], ids=["d64", "d40"])
def test_rope_cache_matches_transformers_for_yarn_and_dynamic(scaling, head_dim):
    max_positions = 256
    hf_scaling = {k: v for k, v in scaling.items() if k != "type"} | {"rope_type": scaling.get("rope_type", "yarn")}
    rotary = _hf_rotary(head_dim, max_positions, 10000.0, hf_scaling)
    cos, sin = rotary(torch.zeros(1), torch.arange(max_positions)[None])
    cache = reference.rope_cos_sin_cache(head_dim, max_positions, 10000.0, scaling)
    half = head_dim // 2
    assert torch.equal(cache[:, :half], cos[0, :, :half]) and torch.equal(cache[:, half:], sin[0, :, :half])
    if scaling.get("rope_type", "yarn") == "yarn":
        assert rotary.attention_scaling != 1.0  # folded into the table, and matched


def test_dynamic_rope_is_default_within_max_position_embeddings_and_refused_beyond():
    dynamic = reference.rope_cos_sin_cache(64, 128, 10000.0, {"rope_type": "dynamic", "factor": 2.0})
    torch.testing.assert_close(dynamic, reference.rope_cos_sin_cache(64, 128, 10000.0), atol=0, rtol=1e-6)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        reference.rope_cos_sin_cache(64, 256, 10000.0, {"rope_type": "dynamic", "factor": 2.0},
                                     max_position_embeddings=128)


def _phi3_rotary(head_dim, partial, max_positions, original, params):
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = Phi3Config(hidden_size=head_dim * 2, num_attention_heads=2, num_key_value_heads=2, pad_token_id=0,
                        max_position_embeddings=max_positions, original_max_position_embeddings=original,
                        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": partial, **params})
    return Phi3RotaryEmbedding(config)


LONGROPE_CASES = {  # (head_dim, partial_rotary_factor, extra parameters)
    "d32-partial-0.75": (32, 0.75, {}),
    "d48-full": (48, 1.0, {}),
    "d64-partial-0.5-attention-factor": (64, 0.5, {"attention_factor": 1.3}),
    "d40-factor-given": (40, 1.0, {"factor": 2.0}),
}


@pytest.mark.parametrize("case", list(LONGROPE_CASES.values()), ids=list(LONGROPE_CASES))
def test_longrope_cache_has_short_then_long_rows_like_transformers_per_call_choice(case):
    head_dim, partial, extra = case
    rotary_dim, max_positions, original = int(head_dim * partial), 256, 64
    half = rotary_dim // 2
    params = {"rope_type": "longrope", "original_max_position_embeddings": original,
              "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [2.0 + 0.5 * i for i in range(half)],
              **extra}  # fmt: skip
    rotary = _phi3_rotary(head_dim, partial, max_positions, original, params)
    cache = reference.rope_cos_sin_cache(head_dim, max_positions, 10000.0, params, rotary_dim=rotary_dim,
                                         max_position_embeddings=max_positions)
    assert cache.shape == (2 * max_positions, rotary_dim)
    for length, rows in ((original, slice(0, original)), (max_positions, slice(max_positions, 2 * max_positions)),
                         (original + 1, slice(max_positions, max_positions + original + 1))):
        cos, sin = rotary(torch.zeros(1), torch.arange(length)[None])  # one call: short or long by its length
        assert torch.equal(cache[rows, :half], cos[0, :, :half]) and torch.equal(cache[rows, half:], sin[0, :, :half])
    assert rotary.attention_scaling != 1.0


def test_partial_rotary_cache_matches_phi3():
    rotary = _phi3_rotary(40, 0.6, 128, 128, {})
    cos, sin = rotary(torch.zeros(1), torch.arange(128)[None])
    cache = reference.rope_cos_sin_cache(40, 128, 10000.0, None, rotary_dim=24)
    assert torch.equal(cache, torch.cat((cos[0, :, :12], sin[0, :, :12]), dim=-1))


@pytest.mark.parametrize("scaling", [ROPE_CASES["linear"], ROPE_MORE_CASES["yarn"]], ids=["linear", "yarn"])
def test_partial_rotary_cache_of_scaled_ropes_matches_transformers(scaling):
    rotary = _hf_rotary(40, 256, 10000.0, {**scaling, "partial_rotary_factor": 0.6})
    cos, sin = rotary(torch.zeros(1), torch.arange(256)[None])
    cache = reference.rope_cos_sin_cache(40, 256, 10000.0, scaling, rotary_dim=24)
    assert torch.equal(cache, torch.cat((cos[0, :, :12], sin[0, :, :12]), dim=-1))


def test_rope_cache_rejects_unknown_scaling_naming_the_supported_ones():
    with pytest.raises(ValueError, match="'ntk-by-parts'.*default, linear, llama3, yarn, longrope, dynamic"):
        reference.rope_cos_sin_cache(64, 16, 10000.0, {"rope_type": "ntk-by-parts", "factor": 2.0})
    with pytest.raises(ValueError, match="rotary_dim"):
        reference.rope_cos_sin_cache(64, 16, 10000.0, rotary_dim=23)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_partial_rotary_embedding_matches_phi3(dtype):
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply

    head_dim, rotary_dim, heads, kv_heads = 64, 48, 3, 1
    rotary = _phi3_rotary(head_dim, rotary_dim / head_dim, 512, 512, {})
    positions = torch.tensor([0, 7, 300, 511, 2])
    q = torch.randn(5, heads, head_dim).to(dtype)
    k = torch.randn(5, kv_heads, head_dim).to(dtype)
    cos, sin = rotary(q, positions[None])
    q_hf, k_hf = phi3_apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    reference.rotary_embedding(positions, q, k, reference.rope_cos_sin_cache(head_dim, 512, 10000.0, rotary_dim=48))
    assert torch.equal(q, q_hf[0].transpose(0, 1)) and torch.equal(k, k_hf[0].transpose(0, 1))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gelu_tanh_and_mul_is_gemmas_geglu(dtype):
    from transformers.activations import ACT2FN

    x = (torch.randn(4, 2 * 37) * 3).to(dtype)
    gemma_act = ACT2FN["gelu_pytorch_tanh"]  # Gemma 2/3's hidden_activation
    assert torch.equal(reference.gelu_tanh_and_mul(x), gemma_act(x[:, :37]) * x[:, 37:])


@pytest.mark.parametrize("head_dim", [24, 80, 128])
def test_rms_norm_per_head_matches_qwen3_q_norm(head_dim):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(head_dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(head_dim))
    q = torch.randn(5, 3 * head_dim)  # [T, heads * head_dim]
    expected = norm(q.view(5, 3, head_dim)).detach()  # transformers normalizes each head's vector
    got = reference.rms_norm(q.reshape(5 * 3, head_dim), norm.weight.detach(), 1e-6)
    assert torch.equal(got.view(5, 3, head_dim), expected)


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


class _Gemma2Module:  # what transformers' eager attention reads from its module
    training = False
    num_key_value_groups = 2


WINDOW_CASES = {  # (window, softcap)
    "window-1": (1, None),
    "window-4": (4, None),
    "window-7-softcap-5": (7, 5.0),
    "softcap-2": (None, 2.0),
    "window-beyond-context": (50, None),
}


def _hf_windowed(q, keys, values, q_offset, window, softcap, scale):
    """transformers' sliding-window causal mask and Gemma 2's eager (soft-capped) attention, one sequence:
    q [n, heads, D] at positions q_offset.., keys/values [ctx, kv_heads, D]."""
    from transformers.masking_utils import (
        causal_mask_function,
        eager_mask,
        sliding_window_causal_mask_function,
    )
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    mask_function = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    mask = eager_mask(batch_size=1, q_length=q.shape[0], kv_length=keys.shape[0], q_offset=q_offset,
                      mask_function=mask_function)  # [1, 1, n, ctx] 0 / -inf  # fmt: skip
    out, _ = eager_attention_forward(_Gemma2Module(), q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                     values.transpose(0, 1)[None], mask, scaling=scale, softcap=softcap)
    return out[0]  # [n, heads, D]


@pytest.mark.parametrize("case", list(WINDOW_CASES.values()), ids=list(WINDOW_CASES))
def test_windowed_soft_capped_attention_matches_transformers_masks_and_gemma2(case):
    window, softcap = case
    heads, head_dim, scale = 4, 8, 0.4
    seq_lens, q_lens = [13, 9, 5], [5, 1, 5]  # a cached prefix and a chunk; a decode-like single token; a prompt
    k_cache, v_cache, block_tables, context_lens = _paged_case(seq_lens)
    cu = torch.tensor([0, *q_lens]).cumsum(0).int()
    q = torch.randn(sum(q_lens), heads, head_dim) * 3
    out = reference.paged_attention_prefill(q, k_cache, v_cache, cu, block_tables, context_lens, scale,
                                            window=window, softcap=softcap)
    decode_rows = cu[1:] - 1  # each sequence's last token, as a decode step
    decode = reference.paged_attention_decode(q[decode_rows], k_cache, v_cache, block_tables, context_lens, scale,
                                              window=window, softcap=softcap)
    for b, (n, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        table = block_tables[b].tolist()
        keys = torch.stack([k_cache[table[j // 4], j % 4] for j in range(n)])  # [n, kv_heads, D]
        values = torch.stack([v_cache[table[j // 4], j % 4] for j in range(n)])
        rows = slice(int(cu[b]), int(cu[b + 1]))
        expected = _hf_windowed(q[rows], keys, values, n - ql, window, softcap, scale)
        torch.testing.assert_close(out[rows], expected)
        torch.testing.assert_close(decode[b], expected[-1])


def test_windowed_decode_of_a_large_batch_equals_each_sequence_alone():
    """Past 16 sequences the reference decodes in length buckets; the window and soft-cap go along."""
    lens = [1 + (7 * i) % 30 for i in range(21)]
    k_cache, v_cache, block_tables, context_lens = _paged_case(lens, num_blocks=200)
    q = torch.randn(len(lens), 4, 8) * 3
    out = reference.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, 0.3, window=6, softcap=4.0)
    for b in range(len(lens)):
        alone = reference.paged_attention_decode(q[b : b + 1], k_cache, v_cache, block_tables[b : b + 1],
                                                 context_lens[b : b + 1], 0.3, window=6, softcap=4.0)
        torch.testing.assert_close(out[b : b + 1], alone)


def test_one_decode_layout_serves_every_layer_and_window_of_a_step():
    """The engine cuts a step's DecodeLayout once (kernels.decode_layout) and passes it to every layer, whose
    windows differ (Gemma's local and global layers): each call equals the call that cuts its own."""
    lens = [1 + (11 * i) % 45 for i in range(37)]  # past 16 sequences: three buckets
    k_cache, v_cache, block_tables, context_lens = _paged_case(lens, num_blocks=300)
    meta = kernels.decode_layout(block_tables, context_lens, k_cache)
    for window, softcap in ((None, None), (7, 4.0), (None, None), (7, None), (1, None)):
        q = torch.randn(len(lens), 4, 8) * 3
        shared = reference.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, 0.3,
                                                  window=window, softcap=softcap, meta=meta)
        own = reference.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, 0.3, window=window,
                                               softcap=softcap)
        torch.testing.assert_close(shared, own, rtol=0, atol=0)
    assert sorted(meta.buckets, key=str) == [1, 7, None]
    with pytest.raises(ValueError, match="other block tables"):
        reference.paged_attention_decode(q, k_cache, v_cache, block_tables.clone(), context_lens, 0.3, meta=meta)


def test_window_one_sees_only_the_token_itself():
    k_cache, v_cache, block_tables, context_lens = _paged_case([6])
    q = torch.randn(1, 4, 8)
    out = reference.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, 0.3, window=1)
    last = int(block_tables[0, 1]), 1  # position 5: block 1, offset 1
    torch.testing.assert_close(out[0], v_cache[last].repeat_interleave(2, dim=0))


def test_attention_refuses_a_bad_window_or_softcap():
    k_cache, v_cache, block_tables, context_lens = _paged_case([3])
    q = torch.randn(1, 4, 8)
    for bad in ({"window": 0}, {"window": 2.5}, {"softcap": 0.0}):
        with pytest.raises(ValueError, match="window|softcap"):
            reference.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, 0.3, **bad)


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="switches Triton to its interpreter: CPU runs only")
def test_routing_sends_cpu_tensors_to_the_triton_launchers():
    from kernels import interpreter

    x = torch.randn(2, 2 * 6)
    interpreter.enable()
    try:
        assert kernels.backend_for(x) == "triton"
        torch.testing.assert_close(kernels.gelu_tanh_and_mul(x), reference.gelu_tanh_and_mul(x))
    finally:
        interpreter.disable_routing()
    assert kernels.backend_for(x) == "reference"


def test_op_names_stay_dispatch_functions_after_submodule_imports():
    importlib.import_module("kernels.lora_shrink")
    importlib.import_module("kernels.rms_norm")
    assert kernels.lora_shrink.__module__ == "kernels" and kernels.rms_norm.__module__ == "kernels"
    assert "x[t] @ pages[a_rows" in kernels.lora_shrink.__doc__
