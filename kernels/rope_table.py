"""The cos/sin tables of rotary embeddings for every rope type the supported configs carry, computed as
transformers 5.23 computes them (modeling_rope_utils) and checked against it (tests/kernels/test_reference.py).
Plain PyTorch: the table is built once, on the host, and moved to the device with the model."""

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


def rope_cos_sin_cache(
    head_dim: int,
    max_positions: int,
    theta: float,
    rope_scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    rotary_dim: int | None = None,
    max_position_embeddings: int | None = None,
) -> torch.Tensor:
    """cos/sin table for rotary embeddings, identical to transformers' (5.23) rotary embeddings.

    R = rotary_dim (default head_dim; int(head_dim * partial_rotary_factor) for a partial rotary)
    inv_freq[i] = 1 / theta ** (2i / R), i < R / 2, rescaled by rope_scaling's "rope_type" (or legacy "type"):
      "default"   unchanged;
      "linear"    inv_freq / factor;
      "llama3"    wavelength-dependent, smoothed between low_freq_factor and high_freq_factor;
      "yarn"      blended between inv_freq / factor and inv_freq over the dims from beta_fast to beta_slow
                  rotations (default 32, 1) in original_max_position_embeddings (range floored/ceiled unless
                  truncate is false); attention factor = attention_factor, or from mscale / mscale_all_dim,
                  or 0.1 ln(factor) + 1;
      "longrope"  inv_freq / short_factor[i] and inv_freq / long_factor[i] (see below); attention factor =
                  attention_factor, or sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) (1 if
                  factor <= 1), factor defaulting to max_position_embeddings / original_max_position_embeddings;
      "dynamic"   (dynamic NTK) transformers recomputes inv_freq only once a sequence grows past
                  max_position_embeddings; below it the table is its base formula at that length, i.e.
                  "default" up to rounding; max_positions beyond max_position_embeddings is refused.
    freqs[p, i] = p * inv_freq[i] (float32); cache[p] = cat(cos(freqs[p]), sin(freqs[p])) * attention factor
    (1 except for yarn and longrope: transformers multiplies cos and sin by it).

    rope_scaling: None or a config dict with "rope_type" and its parameters; max_position_embeddings: the
    config's (default max_positions), read by "dynamic" and by yarn/longrope without a "factor".
    returns cache [max_positions, R] in dtype; for "longrope" [2 * max_positions, R]: rows [0, max_positions)
    with short_factor, rows [max_positions, 2 * max_positions) with long_factor. transformers picks the long
    factors for a whole forward call once its longest position reaches original_max_position_embeddings;
    the model reproduces that by adding max_positions to the positions of such a call's tokens.
    Unknown rope types raise ValueError naming the supported ones.
    """
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
    scaling = dict(rope_scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    max_position_embeddings = max_position_embeddings or max_positions
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    tables = [
        _cos_sin(positions, inv_freq, attention_factor)
        for inv_freq, attention_factor in _rope_frequencies(rope_type, scaling, rotary_dim, theta, max_positions,
                                                            max_position_embeddings)
    ]
    return torch.cat(tables).to(dtype)



def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float) -> torch.Tensor:
    freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, R / 2]
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat((cos, sin), dim=-1)


def _rope_frequencies(rope_type: str, scaling: dict, dim: int, theta: float, max_positions: int,
                      max_position_embeddings: int) -> list[tuple[torch.Tensor, float]]:
    """(inv_freq [dim / 2], attention factor) per table section, each as transformers computes it."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim / 2]
    if rope_type == "default":
        return [(1.0 / theta**exponents, 1.0)]
    if rope_type == "linear":
        return [(1.0 / theta**exponents / scaling["factor"], 1.0)]
    if rope_type == "llama3":
        return [(_llama3_inv_freq(1.0 / theta**exponents, scaling), 1.0)]
    if rope_type == "dynamic":
        if max_positions > max_position_embeddings:
            raise ValueError(f"dynamic rope beyond max_position_embeddings ({max_position_embeddings}) is not "
                             f"supported; got max_positions {max_positions}")
        factor = scaling["factor"]
        seq_len = max_position_embeddings  # transformers' length until a sequence grows past it
        base = theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        return [(1.0 / base**exponents, 1.0)]
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    if rope_type == "yarn":
        return [_yarn(scaling, dim, theta, factor, original)]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return [
        (1.0 / (torch.tensor(scaling[key], dtype=torch.float32) * theta**exponents), attention_factor)
        for key in ("short_factor", "long_factor")
    ]


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(scaling: dict, dim: int, theta: float, factor: float, original: int) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times in `original` tokens
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim / 2]
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor
