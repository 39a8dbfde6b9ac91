"""One memory for the KV cache and adapter weights, in pages.

Each layer owns one tensor [2, num_pages + 1, chunk] with chunk = block_size * kv_heads * head_dim.
Page p is, in every layer, the pair of chunks (K half, V half) at index p: either KV block p of the
paged cache (layer l's k_cache[p] and v_cache[p]) or one page of an adapter's rows for that layer.
Page `num_pages` is never handed out and stays zero. The block manager hands out page ids to both
uses from one free list, so adapters and the KV cache share one budget.
"""

import torch


class PagedMemory:
    def __init__(self, *, num_layers: int, num_pages: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_pages = num_pages
        self.chunk = block_size * kv_heads * head_dim
        self.kv_shape = (num_pages, block_size, kv_heads, head_dim)
        self.layers = [torch.zeros(2, num_pages + 1, self.chunk, dtype=dtype, device=device)
                       for _ in range(num_layers)]  # [K/V, pages + zero page, chunk]
        self._flat = [t.view(-1) for t in self.layers]
        self.page_bytes = 2 * num_layers * self.chunk * self.layers[0].element_size()

    @staticmethod
    def bytes_per_page(*, num_layers: int, block_size: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * itemsize

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's (k_cache, v_cache), each [num_pages, block_size, kv_heads, head_dim], contiguous views."""
        t = self.layers[layer]
        return t[0, : self.num_pages].view(self.kv_shape), t[1, : self.num_pages].view(self.kv_shape)

    def flat(self, layer: int) -> torch.Tensor:
        """Layer's whole memory as one flat tensor: the `pages` the LoRA kernels read rows from."""
        return self._flat[layer]

    def chunk_start(self, page: int, half: int) -> int:
        """Element offset, in `flat(layer)`, of page's K (half 0) or V (half 1) chunk."""
        return (half * (self.num_pages + 1) + page) * self.chunk

    @property
    def zero_row(self) -> int:
        """Offset of the zero page: where the page tables of absent rows point."""
        return self.chunk_start(self.num_pages, 0)
