"""One memory for the KV cache and adapter weights, in pages.

Each layer owns one tensor [2, num_pages + 1, chunk] in the model dtype. Page p is, in every layer,
the pair of chunks (K half, V half) at index p: either KV block p of the paged cache (layer l's
k_cache[p] and v_cache[p]) or one page of an adapter's rows for that layer. Page `num_pages` is never
handed out and stays zero. The block manager hands out page ids to both uses from one free list, so
adapters and the KV cache share one budget.

A chunk is the bytes of one KV block half: block_size * kv_heads * head_dim values of the KV cache
dtype. With an fp8 KV cache (kv_dtype float8_e4m3fn) the KV views read those bytes as fp8, adapter
rows still read them in the model dtype (so a chunk holds fewer adapter values), and each layer has
a float32 scale per token and KV head of every page: scales [2, num_pages + 1, block_size * kv_heads],
counted in the page's bytes (docs/quantization.md).
"""

import math

import torch

ROW_ALIGN = 8  # adapter rows start at multiples of this many values (16 bytes in bf16): the LoRA kernels' vector loads


class PagedMemory:
    def __init__(self, *, num_layers: int, num_pages: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, kv_dtype: torch.dtype | None = None) -> None:
        self.num_pages = num_pages
        self.kv_dtype = kv_dtype or dtype
        self.chunk = self.chunk_values(block_size=block_size, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                                       kv_dtype=self.kv_dtype)
        self.kv_shape = (num_pages, block_size, kv_heads, head_dim)
        self.layers = [torch.zeros(2, num_pages + 1, self.chunk, dtype=dtype, device=device)
                       for _ in range(num_layers)]  # [K/V, pages + zero page, chunk]
        self._flat = [t.view(-1) for t in self.layers]
        self.scales = None
        if self.kv_dtype != dtype:
            self.scales = [torch.zeros(2, num_pages + 1, block_size * kv_heads, dtype=torch.float32, device=device)
                           for _ in range(num_layers)]  # [K/V, pages + zero page, block_size * kv_heads]
        self.page_bytes = self.bytes_per_page(num_layers=num_layers, block_size=block_size, kv_heads=kv_heads,
                                              head_dim=head_dim, itemsize=self.kv_dtype.itemsize,
                                              kv_scales=self.scales is not None)

    @staticmethod
    def chunk_values(*, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                     kv_dtype: torch.dtype) -> int:
        """Values of the model dtype in a chunk (what adapter rows are laid out in)."""
        kv_bytes = block_size * kv_heads * head_dim * kv_dtype.itemsize
        if kv_bytes % dtype.itemsize:
            raise ValueError(f"a KV block half of {kv_bytes} bytes is not a whole number of {dtype} values")
        return kv_bytes // dtype.itemsize

    @staticmethod
    def bytes_per_page(*, num_layers: int, block_size: int, kv_heads: int, head_dim: int, itemsize: int,
                       kv_scales: bool = False) -> int:
        """itemsize: of the KV cache dtype; kv_scales: an fp8 cache's float32 scale per token and head."""
        per_token_head = head_dim * itemsize + (4 if kv_scales else 0)
        return 2 * num_layers * block_size * kv_heads * per_token_head

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's (k_cache, v_cache), each [num_pages, block_size, kv_heads, head_dim] in the KV dtype,
        contiguous views."""
        t = self.layers[layer]
        k, v = t[0, : self.num_pages], t[1, : self.num_pages]
        if self.kv_dtype != t.dtype:
            k, v = k.view(self.kv_dtype), v.view(self.kv_dtype)
        return k.view(self.kv_shape), v.view(self.kv_shape)

    def kv_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer's (k_scales, v_scales), each [num_pages, block_size, kv_heads] float32, for an fp8 cache."""
        if self.scales is None:
            return None, None
        s = self.scales[layer]
        return s[0, : self.num_pages].view(self.kv_shape[:3]), s[1, : self.num_pages].view(self.kv_shape[:3])

    def flat(self, layer: int) -> torch.Tensor:
        """Layer's whole memory as one flat tensor: the `pages` the LoRA kernels read rows from."""
        return self._flat[layer]

    def chunk_start(self, page: int, half: int) -> int:
        """Element offset, in `flat(layer)`, of page's K (half 0) or V (half 1) chunk."""
        return (half * (self.num_pages + 1) + page) * self.chunk

    @property
    def row_align(self) -> int:
        """Every adapter row placed in this memory starts at a multiple of this many values (engine.adapter_plan
        packs rows at multiples of ROW_ALIGN within a chunk; chunks start at multiples of `chunk`)."""
        return math.gcd(ROW_ALIGN, self.chunk)

    @property
    def zero_row(self) -> int:
        """Offset of the zero page: where the page tables of absent rows point."""
        return self.chunk_start(self.num_pages, 0)
