"""Plain-PyTorch twins of every kernel: the CPU implementation and the test oracle.

Each function has the same signature as its Triton launcher. Attention and LoRA products are
computed in float32 and cast back, so the references are also the tolerance baseline for
float16/bfloat16 runs on a GPU.
"""


import torch
import torch.nn.functional as F

from kernels.decode_layout import DecodeLayout
from kernels.fp8_reference import dequantize_fp8_groups, fp8_block_linear  # noqa: F401 (fp8 checkpoints' GEMM)
from kernels.grouped_rows import grouped_rows
from kernels.lora_reference import expert_lora, lora_delta, lora_expand, lora_shrink  # noqa: F401 (the LoRA references live there)
from kernels.rope_table import ROPE_TYPES, rope_cos_sin_cache  # noqa: F401 (the rotary tables live there)
from kernels.wna16_reference import wna16_grouped_matmul, wna16_linear  # noqa: F401 (integer-weight GEMMs)

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
    keep = slot_mapping >= 0  # [T]: rows with a slot (a padded row of a static batch has none); no host sync
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
    return _gather_blocks(cache, table, block_tables.shape[0], scales)


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, rows: int,
                   scales: torch.Tensor | None = None) -> torch.Tensor:
    """cache [N, bs, kvh, D], blocks [rows * n] (valid block ids) -> float32 [rows, n * bs, kvh, D]."""
    shape = (rows, -1, *cache.shape[2:])
    if cache.dtype != FP8:
        return cache.index_select(0, blocks).view(shape).float()  # [B, L, kvh, D]
    values = cache.view(torch.uint8).index_select(0, blocks).view(FP8).float()  # [B * n, bs, kvh, D]
    return (values * scales.index_select(0, blocks)[..., None]).view(shape)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
    meta: DecodeLayout | None = None,
) -> torch.Tensor:
    """One query token per sequence attending to its paged context (GQA).

    for b, h: n = context_lens[b]; p = n - 1 (the query's position); g = h // (heads // kv_heads)
        keys[j] = k_cache[block_tables[b, j // bs], j % bs, g] for j < n   (values alike)
        s[j] = scale * q[b, h] @ keys[j]
        s[j] = softcap * tanh(s[j] / softcap)            if softcap is not None
        s[j] = -inf where not (p - window < j)           if window is not None
        out[b, h] = softmax(s) @ values
    (only the blocks from the one the window starts in are read).

    window: sliding-window attention, the query at position p sees keys at p - window < j <= p
    (`window` keys, itself included): transformers' sliding_window_overlay (kv_idx > q_idx - sliding_window)
    and the last sliding_window - 1 cached tokens of its DynamicSlidingWindowLayer, as Mistral, Qwen2,
    Gemma 2 and Gemma 3 use it with config.sliding_window. softcap: Gemma 2's attn_logit_softcapping.

    q [B, heads, D]; k_cache, v_cache [num_blocks, bs, kv_heads, D]; block_tables [B, max_blocks] int;
    context_lens [B] int (>= 1, includes the new token); window int >= 1 or None; softcap float > 0 or None;
    returns out [B, heads, D] in q.dtype. An fp8 cache is read as k_cache * k_scales[..., None]
    (v alike; see store_kv). meta: the step's DecodeLayout of block_tables and context_lens (kernels.decode_layout:
    the buckets of sequences every layer shares), built here when None.
    """
    _check_window_softcap(window, softcap)
    if meta is None:
        meta = DecodeLayout(block_tables, context_lens, k_cache.shape[1], k_cache.shape[0])
    elif meta.block_tables is not block_tables or meta.context_lens is not context_lens:
        raise ValueError("meta: a DecodeLayout of other block tables or context lengths")
    buckets = meta.for_window(window)
    if buckets[0].rows is None:  # one bucket: every sequence
        return _attend_bucket(q, k_cache, v_cache, buckets[0], scale, k_scales, v_scales, softcap)
    out = torch.empty_like(q)  # [B, heads, D]
    for bucket in buckets:
        part = _attend_bucket(q.index_select(0, bucket.rows), k_cache, v_cache, bucket, scale, k_scales, v_scales,
                              softcap)
        out.index_copy_(0, bucket.rows, part)
    return out


def _check_window_softcap(window: int | None, softcap: float | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window: expected an int >= 1 or None, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap: expected a float > 0 or None, got {softcap!r}")


def _attend(q, keys, values, visible, scale, softcap) -> torch.Tensor:
    """softmax(cap(scale * q @ keys.T) masked by visible) @ values, all float32; q [..., M, D], keys and
    values [..., L, D], visible bool broadcastable to [..., M, L]."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale)
    scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale)  # [..., M, L]
    scores.div_(softcap).tanh_().mul_(softcap)  # softcap * tanh(scores / softcap), in place
    return torch.softmax(scores.masked_fill_(~visible, float("-inf")), dim=-1) @ values


def _attend_bucket(q, k_cache, v_cache, bucket, scale, k_scales, v_scales, softcap) -> torch.Tensor:
    """paged_attention_decode of a bucket's sequences (q [n, heads, D]) over their blocks, gathered padded to the
    longest of the bucket."""
    n, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    keys = _gather_blocks(k_cache, bucket.blocks, n, k_scales).transpose(1, 2)  # [n, kvh, L, D]
    values = _gather_blocks(v_cache, bucket.blocks, n, v_scales).transpose(1, 2)
    # the query heads sharing a KV head are that head's query rows: [n, kvh, G, D]
    qg = q.float().view(n, kv_heads, heads // kv_heads, head_dim)
    out = _attend(qg, keys, values, bucket.visible, scale, softcap)  # [n, kvh, G, D]
    return out.reshape(n, heads, head_dim).to(q.dtype)


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
    *,
    window: int | None = None,
    softcap: float | None = None,
    key_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """New tokens of a ragged batch attending causally to cached prefix blocks and to themselves.

    for b: n_b = cu_seqlens_q[b+1] - cu_seqlens_q[b]; c_b = context_lens[b]
        token i of sequence b (row cu_seqlens_q[b] + i) sits at position p = c_b - n_b + i
        lo = 0, or max(0, p - window + 1) with a window; last = key_limits[row] if given, else p
        s[j] = scale * q[row, h] @ keys[j] for lo <= j <= last, capped: softcap * tanh(s[j] / softcap) with a
        softcap
        out[row, h] = softmax(s) @ values[lo:last+1]
        with keys[j] = k_cache[block_tables[b, j // bs], j % bs, h // (heads // kv_heads)]

    window and softcap as in paged_attention_decode (a key at j is seen from p when p - window < j <= p).
    key_limits [T] int (p <= key_limits[row] < c_b): the last key each new token sees, past its own position
    for a token that attends both ways (an image's tokens see the whole image: Gemma 3).
    q [T, heads, D]; k_cache, v_cache [num_blocks, bs, kv_heads, D]; cu_seqlens_q [B + 1] int;
    block_tables [B, max_blocks] int; context_lens [B] int (includes the new tokens, already stored);
    returns out [T, heads, D] in q.dtype. An fp8 cache is read with its scales (paged_attention_decode).
    """
    _check_window_softcap(window, softcap)
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
        first = 0 if window is None else max(0, ctx - n - window + 1) // block_size  # the first block read
        num_blocks = -(-ctx // block_size) - first
        table = block_tables[b : b + 1, first:]
        length = ctx - first * block_size
        # each KV head's keys and values, seen by its G query heads (a broadcast view): [kvh, G, length, D]
        shape = (kv_heads, group, length, head_dim)
        keys = _gather_cache(k_cache, table, num_blocks, k_scales)[0, :length].transpose(0, 1)[:, None].expand(shape)
        values = _gather_cache(v_cache, table, num_blocks, v_scales)[0, :length].transpose(0, 1)[:, None].expand(shape)
        qg = q[start:end].float().view(n, kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [kvh, G, n, D] (a view)
        q_pos = torch.arange(ctx - n, ctx, device=q.device)
        key_pos = torch.arange(first * block_size, ctx, device=q.device)[None, :]
        last = q_pos if key_limits is None else key_limits[start:end].long()  # [n]
        visible = key_pos <= last[:, None]  # [n, ctx]
        if window is not None:
            visible &= key_pos > q_pos[:, None] - window
        attn = _attend(qg, keys, values, visible, scale, softcap)  # [kvh, G, n, D]
        out[start:end] = attn.permute(2, 0, 1, 3).reshape(n, heads, head_dim).to(q.dtype)
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


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Rotate q and k in place, HF "rotate_half" (neox) style, over the first R = cos_sin_cache.shape[1] dims
    of each head (a partial rotary when R < head_dim: dims R.. are left as they are, as Phi-3 does).

    cos, sin = cos_sin_cache[positions[t]] split in halves, each repeated twice to R;
    x[t, h, :R] = x[t, h, :R] * cos + rotate_half(x[t, h, :R]) * sin   for x in (q, k),
    rotate_half(v) = cat(-v[R/2:], v[:R/2]); cos and sin are cast to x.dtype first (as transformers does).

    positions [T] int; q [T, heads, D]; k [T, kv_heads, D]; cos_sin_cache [max_positions, R], R even, R <= D.
    """
    rotary = cos_sin_cache.shape[1]
    half = rotary // 2
    rows = cos_sin_cache.index_select(0, positions.long())  # [T, R]: cos halves, then sin halves
    cos, sin = rows[:, None, :half], rows[:, None, half:]  # [T, 1, R/2] each
    for x in (q, k):
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        first, second = x[..., :half], x[..., half:rotary]
        rotated_first = first * c - second * s  # = first * c + (-second) * s, bit for bit
        second.mul_(c).add_(first * s)
        first.copy_(rotated_first)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Gated MLP activation: out = silu(x[:, :I]) * x[:, I:].

    x [T, 2 * I]; returns out [T, I] in x.dtype.
    """
    inter = x.shape[-1] // 2
    return F.silu(x[..., :inter]) * x[..., inter:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma's gated MLP activation): out = gelu(x[:, :I], approximate="tanh") * x[:, I:].

    x [T, 2 * I]; returns out [T, I] in x.dtype.
    """
    inter = x.shape[-1] // 2
    return F.gelu(x[..., :inter], approximate="tanh") * x[..., inter:]


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> clamp(x / scale, -448, 448) in float8_e4m3fn: a static (calibrated) per-tensor scale [1]
    float32, as compressed-tensors quantizes an activation with its input_scale."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fake_quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, D] rounded to float8_e4m3fn and back, as compressed-tensors' forward quantizes a projection's input:
    q = clamp(x / s, -448, 448) in fp8, returned as q * s in float32 then x.dtype. s: `scale` [T] float32 (a
    static scale per row), or None: dynamic per token, amax(|x[t]|) / 448 (quantize_fp8_rows)."""
    if scale is None:
        q, s = quantize_fp8_rows(x)  # x[t] / s[t] is within 448: no clamp needed
    else:
        s = scale.float()
        q = (x.float() / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return (q.float() * s[:, None]).to(x.dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """An fp8 projection: both operands in float8_e4m3fn, each with one scale per row.

    x is quantized per token on the fly (quantize_fp8_rows: xq[t] = x[t] / sx[t], sx[t] = amax|x[t]| / 448), or
    with a static scale when input_scale [1] float32 is given (quantize_fp8_static: sx[t] = input_scale);
    out[t, o] = sum_i (xq[t, i] * sx[t]) * (weight[o, i] * weight_scale[o]), in float32 and in that order: each
    operand dequantized, then one float32 product, as compressed-tensors' forward computes it (its fake-quantized
    input times its decompressed weight), so the same input gives the same bits.

    x [T, in] float; weight [out, in] float8_e4m3fn; weight_scale [out] float32; returns out [T, out] in x.dtype.
    """
    if input_scale is None:
        xq, x_scale = quantize_fp8_rows(x)  # [T, in] fp8, [T]
    else:
        xq, x_scale = quantize_fp8_static(x, input_scale), input_scale.expand(x.shape[0])
    out = (xq.float() * x_scale[:, None]) @ (weight.float() * weight_scale[:, None]).t()  # [T, out]
    return out.to(x.dtype)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor,
                   weight_scale: torch.Tensor | None = None, group_k: int = 0) -> torch.Tensor:
    """out[r] = x[r] @ weight[e].T for every row r in expert_offsets[e] <= r < expert_offsets[e + 1].

    x [N, in] sorted by expert; weight [E, out, in] (each expert's nn.Linear weight); expert_offsets [E + 1]
    int, non-decreasing, from 0 to N. Returns out [N, out] in x.dtype (float32 accumulation).
    An fp8 weight comes with weight_scale [E, out, cdiv(in, group_k)] float32 and stands for
    weight[e, o, i] * weight_scale[e, o, i // group_k] (the reference dequantizes it for the call).
    The reference is one grouped product (kernels.grouped_rows; the launcher: one grouped launch)."""
    if weight.dtype == FP8:
        weight = dequantize_fp8_groups(weight, weight_scale, group_k)  # [E, out, in] float32
    return grouped_rows(x, weight.transpose(1, 2), expert_offsets).to(x.dtype)  # [N, out]
