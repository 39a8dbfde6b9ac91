"""The engine's quantization settings: which dtypes they mean, and the memory report before and after.

docs/quantization.md gives the design; engine/quantization/on_load.py quantizes the weights and
engine/paged_memory.py lays out an fp8 KV cache."""

import logging
from dataclasses import dataclass

import torch

from engine.paged_memory import PagedMemory

log = logging.getLogger(__name__)

KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}  # None: the model dtype


def kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pages' dtype; fp8 on CUDA needs a GPU with fp8 conversions (compute capability 8.9+)."""
    dtype = KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype
    if dtype != model_dtype and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("kv_cache_dtype 'fp8' needs a GPU of compute capability 8.9 or newer (Ada, Hopper)")
    return dtype


@dataclass
class MemoryReport:
    """Weights and KV, as served and as they would be in the model dtype alone (no quantization)."""

    quantization: str
    kv_cache_dtype: str
    weights_bytes: int
    weights_full_precision_bytes: int
    kv_bytes_per_token: float  # a token's K and V over all layers, fp8 scales included
    kv_bytes_per_token_full_precision: float
    pool_bytes: int  # the one page pool (KV and adapters)
    block_size: int

    @classmethod
    def build(cls, *, quantization: str | None, kv_cache_dtype: str, memory: PagedMemory, weights_bytes: int,
              weights_full_precision_bytes: int, num_layers: int, block_size: int, kv_heads: int, head_dim: int,
              model_dtype: torch.dtype) -> "MemoryReport":
        full_page = PagedMemory.bytes_per_page(num_layers=num_layers, block_size=block_size, kv_heads=kv_heads,
                                               head_dim=head_dim, itemsize=model_dtype.itemsize)
        return cls(quantization=quantization or "none", kv_cache_dtype=str(memory.kv_dtype).removeprefix("torch."),
                   weights_bytes=weights_bytes, weights_full_precision_bytes=weights_full_precision_bytes,
                   kv_bytes_per_token=memory.page_bytes / block_size,
                   kv_bytes_per_token_full_precision=full_page / block_size,
                   pool_bytes=memory.num_pages * memory.page_bytes, block_size=block_size)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV the whole pool holds (adapter pages come out of the same pages)."""
        return int(self.pool_bytes // self.kv_bytes_per_token)

    @property
    def kv_capacity_tokens_full_precision(self) -> int:
        """Tokens the same memory (weights + pool) would hold with nothing quantized."""
        saved = self.weights_full_precision_bytes - self.weights_bytes
        return int((self.pool_bytes + saved) // self.kv_bytes_per_token_full_precision)

    def as_dict(self) -> dict:
        return {
            "quantization": self.quantization,
            "kv_cache_dtype": self.kv_cache_dtype,
            "base_weights_full_precision_bytes": self.weights_full_precision_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_per_token_full_precision": self.kv_bytes_per_token_full_precision,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "kv_capacity_tokens_full_precision": self.kv_capacity_tokens_full_precision,
        }

    def log(self) -> None:
        mib = 1 << 20
        log.info("memory: base weights %.1f MiB (%.1f MiB unquantized; quantization %s); page pool %.1f MiB: "
                 "%d KV tokens at %.0f bytes/token, kv_cache_dtype %s (%d tokens in the model dtype)",
                 self.weights_bytes / mib, self.weights_full_precision_bytes / mib, self.quantization,
                 self.pool_bytes / mib, self.kv_capacity_tokens, self.kv_bytes_per_token, self.kv_cache_dtype,
                 self.kv_capacity_tokens_full_precision)
