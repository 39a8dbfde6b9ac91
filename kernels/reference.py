"""Plain-PyTorch twins of every kernel: the CPU implementation and the test oracle.

Each function has the same signature as its Triton launcher. Attention and LoRA products are
computed in float32 and cast back, so the references are also the tolerance baseline for
float16/bfloat16 runs on a GPU.
"""

import math

import torch
import torch.nn.functional as F

from kernels.lora_reference import lora_expand, lora_shrink  # noqa: F401 (the LoRA references live there)

_SUPPORTED_ROPE = ("default", "linear", "llama3")
_DECODE_BUCKET = 16  # decode attention pads sequences in buckets of about this many
_DECODE_MAX_BUCKETS = 4
FP8 = torch.float8_e4m3fn  # the fp8 KV cache's storage dtype
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_MIN_SCALE = 1e-12  # the scale of an all-zero row


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Write new keys/values into the paged cache.

    for t in range(T): if slot_mapping[t] >= 0:
        blk, off = divmod(slot_mapping[t], block_size)
        k_cache[blk, off] = k[t]; v_cache[blk, off] = v[t]

    An fp8 (float8_e4m3fn) cache stores each token's head quantized with its own float32 scale:
    k_scales[blk, off, h] = max(amax(|k[t, h]|) / 448, FP8_MIN_SCALE); k_cache[blk, off, h] = k[t, h] / that.

    k, v [T, kv_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]
    (contiguous); slot_mapping [T] int; k_scales, v_scales [num_blocks, block_size, kv_heads] float32
    for an fp8 cache, else None.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
        rows = x[keep]  # [N, kv_heads, D]
        if cache.dtype == FP8:
            rows, row_scales = quantize_fp8_rows(rows)
            scales.view(-1, scales.shape[2]).index_copy_(0, slots, row_scales)
            cache.view(torch.uint8).view(-1, *cache.shape[2:]).index_copy_(0, slots, rows.view(torch.uint8))
        else:
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows.to(cache.dtype))


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (x / s in float8_e4m3fn [..., D], s [...] float32), s = max(amax(|x|, -1) / 448, FP8_MIN_SCALE)."""
    x32 = x.float()
    scales = (x32.abs().amax(-1) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return (x32 / scales[..., None]).to(FP8), scales


def _gather_cache(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int,
                  scales: torch.Tensor | None = None) -> torch.Tensor:
    """cache [N, bs, kvh, D], block_tables [B, >=num_blocks] -> float32 [B, num_blocks * bs, kvh, D]
    (an fp8 cache dequantized with its scales [N, bs, kvh])."""
    table = block_tables[:, :num_blocks].clamp(min=0, max=cache.shape[0] - 1).flatten()  # [B * num_blocks]
    shape = (block_tables.shape[0], num_blocks * cache.shape[1], *cache.shape[2:])
    if cache.dtype != FP8:
        return cache.index_select(0, table).view(shape).float()  # [B, L, kvh, D]
    values = cache.view(torch.uint8).index_select(0, table).view(FP8).float()  # [B * num_blocks, bs, kvh, D]
    return (values * scales.index_select(0, table)[..., None]).view(shape)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence attending to its whole paged context (GQA).

    for b, h: n = context_lens[b]; g = h // (heads // kv_heads)
        keys[j] = k_cache[block_tables[b, j // bs], j % bs, g] for j < n   (values alike)
        out[b, h] = softmax(scale * q[b, h] @ keys.T) @ values

    q [B, heads, D]; k_cache, v_cache [num_blocks, bs, kv_heads, D]; block_tables [B, max_blocks] int;
    context_lens [B] int (>= 1, includes the new token); returns out [B, heads, D] in q.dtype.
    An fp8 cache is read as k_cache * k_scales[..., None] (v alike; see store_kv).
    """
    batch = q.shape[0]
    if batch <= _DECODE_BUCKET:
        return _attend_padded(q, k_cache, v_cache, block_tables, context_lens, scale, k_scales, v_scales)
    # sequences sorted by length, in buckets each padded to its own longest: less padding to gather
    lens = context_lens.tolist()
    order = sorted(range(batch), key=lens.__getitem__)
    num_buckets = min(_DECODE_MAX_BUCKETS, -(-batch // _DECODE_BUCKET))
    out = torch.empty_like(q)  # [B, heads, D]
    for i in range(num_buckets):
        rows = torch.tensor(order[i * batch // num_buckets : (i + 1) * batch // num_buckets], device=q.device)
        part = _attend_padded(
            q.index_select(0, rows), k_cache, v_cache, block_tables.index_select(0, rows),
            context_lens.index_select(0, rows), scale, k_scales, v_scales,
        )
        out.index_copy_(0, rows, part)
    return out


def _attend_padded(q, k_cache, v_cache, block_tables, context_lens, scale, k_scales, v_scales) -> torch.Tensor:
    """paged_attention_decode over the context gathered padded to the longest of the batch."""
    batch, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = -(-int(context_lens.max()) // block_size)
    keys = _gather_cache(k_cache, block_tables, num_blocks, k_scales).transpose(1, 2)  # [B, kvh, L, D]
    values = _gather_cache(v_cache, block_tables, num_blocks, v_scales).transpose(1, 2)
    pos = torch.arange(keys.shape[2], device=q.device)
    visible = (pos[None, :] < context_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    # the query heads sharing a KV head are that head's query rows: [B, kvh, G, D]
    qg = q.float().view(batch, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=visible, scale=scale)  # [B, kvh, G, D]
    return out.reshape(batch, heads, head_dim).to(q.dtype)


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """New tokens of a ragged batch attending causally to cached prefix blocks and to themselves.

    for b: n_b = cu_seqlens_q[b+1] - cu_seqlens_q[b]; c_b = context_lens[b]
        token i of sequence b (row cu_seqlens_q[b] + i) sits at position p = c_b - n_b + i
        out[row, h] = softmax(scale * q[row, h] @ keys[:p+1].T) @ values[:p+1]
        with keys[j] = k_cache[block_tables[b, j // bs], j % bs, h // (heads // kv_heads)]

    q [T, heads, D]; k_cache, v_cache [num_blocks, bs, kv_heads, D]; cu_seqlens_q [B + 1] int;
    block_tables [B, max_blocks] int; context_lens [B] int (includes the new tokens, already stored);
    returns out [T, heads, D] in q.dtype. An fp8 cache is read with its scales (paged_attention_decode).
    """
    total, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(q)  # [T, heads, D]
    bounds = cu_seqlens_q.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        start, end = bounds[b], bounds[b + 1]
        n = end - start
        if n == 0:
            continue
        num_blocks = -(-ctx // block_size)
        table = block_tables[b : b + 1]
        keys = _gather_cache(k_cache, table, num_blocks, k_scales)[0, :ctx].transpose(0, 1)  # [kvh, ctx, D]
        values = _gather_cache(v_cache, table, num_blocks, v_scales)[0, :ctx].transpose(0, 1)
        # each KV head's query rows: its G query heads, each over the n new tokens: [kvh, G * n, D]
        qg = q[start:end].float().view(n, kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(kv_heads, group * n, head_dim)
        q_pos = torch.arange(ctx - n, ctx, device=q.device)
        visible = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # [n, ctx]
        attn = F.scaled_dot_product_attention(qg, keys, values, attn_mask=visible.repeat(group, 1), scale=scale)
        out[start:end] = attn.view(kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, heads, head_dim).to(q.dtype)
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with optional fused residual add (transformers' LlamaRMSNorm semantics).

    h = x if residual is None else (x + residual)          # in x.dtype
    out = weight * (h / sqrt(mean(h**2, -1) + eps)).to(x.dtype)   # the norm in float32
    returns out, or (out, h) when residual is given.

    x [T, hidden]; weight [hidden]; residual [T, hidden] or None; out, h [T, hidden].
    """
    hidden = x if residual is None else x + residual
    h32 = hidden.float()
    normed = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)
    return out if residual is None else (out, hidden)


def rope_cos_sin_cache(
    head_dim: int,
    max_positions: int,
    theta: float,
    rope_scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """cos/sin table for rotary embeddings, identical to transformers' Llama rotary embedding.

    inv_freq[i] = 1 / theta ** (2i / head_dim), i < head_dim / 2, then rescaled for
    rope_type "linear" (inv_freq / factor) or "llama3" (wavelength-dependent, smoothed);
    freqs[p, i] = p * inv_freq[i] (float32); cache[p] = cat(cos(freqs[p]), sin(freqs[p])).

    rope_scaling: None or a config dict with "rope_type" (or legacy "type") and its parameters.
    returns cache [max_positions, head_dim] in dtype.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    inv_freq = _scale_inv_freq(inv_freq, rope_scaling)
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _scale_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict | None) -> torch.Tensor:
    rope_type = "default" if not rope_scaling else rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type not in _SUPPORTED_ROPE:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(_SUPPORTED_ROPE)}")
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "default":
        return inv_freq
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Rotate q and k in place, HF "rotate_half" (neox) style.

    cos, sin = cos_sin_cache[positions[t]] split in halves, each repeated twice to head_dim;
    x[t, h] = x[t, h] * cos + rotate_half(x[t, h]) * sin   for x in (q, k),
    rotate_half(v) = cat(-v[D/2:], v[:D/2]); cos and sin are cast to x.dtype first (as transformers does).

    positions [T] int; q [T, heads, D]; k [T, kv_heads, D]; cos_sin_cache [max_positions, D].
    """
    half = cos_sin_cache.shape[1] // 2
    rows = cos_sin_cache[positions.long()]  # [T, D]
    cos = torch.cat((rows[:, :half], rows[:, :half]), dim=-1)[:, None, :]  # [T, 1, D]
    sin = torch.cat((rows[:, half:], rows[:, half:]), dim=-1)[:, None, :]
    for x in (q, k):
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * c + rotated * s)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Gated MLP activation: out = silu(x[:, :I]) * x[:, I:].

    x [T, 2 * I]; returns out [T, I] in x.dtype.
    """
    inter = x.shape[-1] // 2
    return F.silu(x[..., :inter]) * x[..., inter:]


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """An fp8 projection: both operands in float8_e4m3fn, each with one scale per row.

    x is quantized per token on the fly (quantize_fp8_rows: xq[t] = x[t] / sx[t], sx[t] = amax|x[t]| / 448);
    out[t, o] = sx[t] * weight_scale[o] * sum_i xq[t, i] * weight[o, i], summed in float32.

    x [T, in] float; weight [out, in] float8_e4m3fn; weight_scale [out] float32; returns out [T, out] in x.dtype.
    """
    xq, x_scale = quantize_fp8_rows(x)  # [T, in] fp8, [T]
    out = (xq.float() @ weight.float().t()) * x_scale[:, None] * weight_scale[None, :]  # [T, out]
    return out.to(x.dtype)
