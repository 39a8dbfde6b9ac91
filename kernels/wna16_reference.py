"""The plain-PyTorch reference of kernels.wna16_linear (4- or 8-bit integer weights, activations in their float
dtype), and the packing it reads: the CPU path and the Triton launcher's test oracle.

Layout (GPTQ's, which every integer checkpoint format is repacked into at load: engine/quantization/):
p = 32 // bits values share one int32, the first in the lowest bits.
- qweight [K // p, N] int32: q[k, n] = (qweight[k // p, n] >> (bits * (k % p))) & (2**bits - 1);
- zeros [G, N // p] int32, packed along n: z[g, n] = (zeros[g, n // p] >> (bits * (n % p))) & (2**bits - 1);
- scales [G, N] float; g_idx [K] int32 in [0, G): the group of input channel k.
W[k, n] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n]."""

import torch

WNA16_BITS = (4, 8)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """values [K, N] in [0, 2**bits) -> [K // p, N] int32, p = 32 // bits consecutive rows per int32."""
    per = 32 // bits
    rows, cols = values.shape
    v = values.to(torch.int64).reshape(rows // per, per, cols)
    shifts = (torch.arange(per, dtype=torch.int64) * bits).to(values.device)[None, :, None]
    return _to_int32((v << shifts).sum(1))


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of pack_rows: [K // p, N] int32 -> [K, N] int32."""
    per = 32 // bits
    shifts = (torch.arange(per, dtype=torch.int32, device=packed.device) * bits)[None, :, None]
    values = (packed[:, None, :] >> shifts) & ((1 << bits) - 1)  # [K // p, p, N]
    return values.reshape(-1, packed.shape[1])


def pack_cols(values: torch.Tensor, bits: int) -> torch.Tensor:
    """values [G, N] in [0, 2**bits) -> [G, N // p] int32, p consecutive columns per int32."""
    return pack_rows(values.t(), bits).t().contiguous()


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    return unpack_rows(packed.t(), bits).t()


def _to_int32(values: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> the int32 with those bits."""
    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32)


def wna16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
                     bits: int) -> torch.Tensor:
    """W [K, N] float32 of the packed weight (the layout above)."""
    q = unpack_rows(qweight, bits)  # [K, N]
    z = unpack_cols(zeros, bits)  # [G, N]
    g = g_idx.long()
    return (q - z[g]).float() * scales.float()[g]


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 g_idx: torch.Tensor, bits: int, *, group_size: int = 0, perm: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """y = x @ W, W [K, N] = (q - z[g_idx]) * scales[g_idx] (the layout above), bits 4 or 8.

    x [T, K] float; qweight [K // p, N] int32; scales [G, N] float; zeros [G, N // p] int32; g_idx [K] int32.
    group_size > 0 promises g_idx[k] == k // group_size (groups in order: the Triton kernel then reads one row of
    scales per tile; here g_idx is read all the same). perm [K] (act order sorted at load): y = x[:, perm] @ W.
    Returns y [T, N] in x.dtype, the product taken in float32."""
    w = wna16_dequantize(qweight, scales, zeros, g_idx, bits)
    x = x if perm is None else x[:, perm.long()]
    return (x.float() @ w).to(x.dtype)


def wna16_grouped_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         g_idx: torch.Tensor, expert_offsets: torch.Tensor, bits: int, *, group_size: int = 0,
                         perm: torch.Tensor | None = None) -> torch.Tensor:
    """out[r] = x[r] @ W[e] for every row r in expert_offsets[e] <= r < expert_offsets[e + 1], W[e] the packed
    weight of expert e (the layout above, stacked): the experts of an MoE layer in 4 or 8 bits.

    x [N, K] sorted by expert; qweight [E, K // p, M] int32; scales [E, G, M]; zeros [E, G, M // p] int32;
    g_idx [E, K] int32; expert_offsets [E + 1] int, from 0 to N; group_size as wna16_linear's; perm [E, K] or None. Returns out [N, M]
    in x.dtype."""
    out = torch.empty(x.shape[0], qweight.shape[2], dtype=x.dtype, device=x.device)
    bounds = expert_offsets.tolist()
    for e in range(qweight.shape[0]):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            out[start:end] = wna16_linear(x[start:end], qweight[e], scales[e], zeros[e], g_idx[e], bits,
                                          perm=None if perm is None else perm[e])
    return out
