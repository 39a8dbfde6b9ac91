"""Checks and small helpers shared by the Triton launchers."""

import torch
import triton
import triton.language as tl

INDEX_DTYPES = (torch.int32, torch.int64)
FP8 = torch.float8_e4m3fn  # the fp8 KV cache's storage dtype (kernels.reference.store_kv)
FP8_MAX: tl.constexpr = tl.constexpr(448.0)  # largest finite float8_e4m3fn
FP8_MIN_SCALE: tl.constexpr = tl.constexpr(1e-12)  # the scale of an all-zero row
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def require_shape(name: str, tensor: torch.Tensor, shape: tuple) -> None:
    require(tuple(tensor.shape) == tuple(shape), f"{name}: expected shape {tuple(shape)}, got {tuple(tensor.shape)}")


def require_index(name: str, tensor: torch.Tensor, length: int | None = None) -> None:
    require(tensor.dtype in INDEX_DTYPES, f"{name}: expected int32/int64, got {tensor.dtype}")
    require(tensor.is_contiguous(), f"{name}: must be contiguous")
    if length is not None:
        require_shape(name, tensor, (length,))


def require_float(name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    require(tensor.dtype in FLOAT_DTYPES, f"{name}: expected float32/float16/bfloat16, got {tensor.dtype}")
    if dtype is not None:
        require(tensor.dtype == dtype, f"{name}: expected {dtype}, got {tensor.dtype}")


def require_contiguous(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        require(tensor.is_contiguous(), f"{name}: must be contiguous")


def require_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        require(tensor.stride(-1) == 1, f"{name}: last dimension must be contiguous")


def require_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    require(len(set(devices.values())) == 1, f"tensors on different devices: {devices}")


def require_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, *, batch: int, rows: str
) -> tuple[int, int, int, int]:
    """The checks both paged-attention launchers make; returns (heads, head_dim, block_size, kv_heads)."""
    require(q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
            f"q [{rows}, heads, D], caches [num_blocks, bs, kv_heads, D]: got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")  # fmt: skip
    _, heads, head_dim = q.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    require(cache_dim == head_dim, f"cache head_dim {cache_dim} != q head_dim {head_dim}")
    require(heads % kv_heads == 0, f"heads {heads} not a multiple of kv_heads {kv_heads}")
    require(block_size & (block_size - 1) == 0, f"block size must be a power of two, got {block_size}")
    require_float("q", q)
    require(k_cache.dtype == v_cache.dtype, f"k_cache {k_cache.dtype} != v_cache {v_cache.dtype}")
    require(block_tables.dim() == 2 and block_tables.shape[0] == batch,
            f"block_tables: expected [{batch}, max_blocks], got {tuple(block_tables.shape)}")  # fmt: skip
    require_index("block_tables", block_tables)
    require_contiguous(k_cache=k_cache, v_cache=v_cache)
    require_last_dim_contiguous(q=q)
    return heads, head_dim, block_size, kv_heads


def require_kv_scales(cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None) -> bool:
    """An fp8 cache [N, bs, kvh, D] comes with float32 scales [N, bs, kvh] (contiguous); others with none.
    Returns whether the cache is fp8."""
    if cache.dtype != FP8:
        require(k_scales is None and v_scales is None, f"k_scales/v_scales are for an fp8 cache, not {cache.dtype}")
        return False
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        require(scales is not None, f"{name}: an fp8 cache needs its scales")
        require(scales.dtype == torch.float32 and scales.is_contiguous(), f"{name}: expected contiguous float32")
        require_shape(name, scales, cache.shape[:3])
        require_same_device(cache=cache, **{name: scales})
    return True


def require_window_softcap(window: int | None, softcap: float | None) -> None:
    """A sliding window is an int >= 1 (keys p - window < j <= p), a soft-cap a positive float; None: none."""
    require(window is None or (isinstance(window, int) and not isinstance(window, bool) and window >= 1),
            f"window: expected an int >= 1 or None, got {window!r}")  # fmt: skip
    require(softcap is None or softcap > 0, f"softcap: expected a float > 0 or None, got {softcap!r}")


@triton.jit
def tanh(x):
    """tanh from exp (the interpreter runs no libdevice): 1 - 2 / (e^2x + 1), exactly +-1 at the extremes."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


def dot_precision(dtype: torch.dtype) -> str | None:
    """float32 inputs multiply in full precision (no TF32), so float32 results match the reference;
    half-precision inputs keep the backend's default."""
    return "ieee" if dtype == torch.float32 else None


def next_power_of_2(value: int) -> int:
    """The smallest power of two >= value (>= 1); plain Python: triton's helpers are slow to call from the host."""
    return 1 << (max(int(value), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of ints, for grids (triton.cdiv costs a constexpr_function call on the hot path)."""
    return -(-a // b)


_SM_COUNTS: dict[int, int] = {}


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a small constant under the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]
