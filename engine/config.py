"""One flat, validated configuration for the engine."""

import warnings
from dataclasses import dataclass
from pathlib import Path

DTYPES = ("float32", "float16", "bfloat16")
QUANTIZATIONS = ("int8", "fp8")  # fp8 on CPU runs the reference path (docs/quantization.md)
KV_CACHE_DTYPES = ("auto", "fp8")
SPECULATIVE_METHODS = (None, "ngram", "draft")
ROLES = ("prefill", "decode", "both")
DEPRECATED = {"max_adapter_slots": "pool_adapters_at_max_rank", "adapter_memory_bytes": "pool_adapter_bytes"}  # disaggregated serving (docs/kv-tiers.md): a routing preference


@dataclass
class EngineConfig:
    model: str
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int | None = None  # tokens per KV page; None: 16, or the smallest power of two above whose page
    # holds an adapter row (engine/page_budget.py fitting_block_size; the engine's config then holds the one chosen)
    num_kv_blocks: int | None = None  # pages for the KV cache; None: sized from the memory (see docs/engine-memory.md)
    kv_cache_memory_fraction: float = 0.8  # CUDA: share of free memory for the one page pool (KV + adapters)
    kv_landing_bytes: int = 0  # CUDA: bytes of that share kept out of the pool for the NIXL landing area, where
    # other engines push KV blocks (engine/kv/nixl.py; the server sets it from --kv-transfer-landing-mb)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_adapter_rank: int = 64  # the largest rank an adapter module may have (its page rows are sized by it)
    # the one page pool (docs/engine-memory.md): with num_kv_blocks set, or on CPU, it is num_kv_blocks pages plus
    # pool_adapter_bytes; KV blocks and adapter pages take from all of it, neither has a share of its own
    pool_adapter_bytes: int | None = None  # bytes of pages added to the pool for adapters; None: the bytes of
    # pool_adapters_at_max_rank adapters (on CUDA without num_kv_blocks the pool is sized from memory instead)
    pool_adapters_at_max_rank: int = 8  # sizes the default pool_adapter_bytes: this many adapters of
    # max_adapter_rank on every projection; not a cap on the adapters in memory (there is none)
    max_adapter_slots: int | None = None  # deprecated name of pool_adapters_at_max_rank (mapped, with a warning)
    adapter_memory_bytes: int | None = None  # deprecated name of pool_adapter_bytes (mapped, with a warning)
    host_adapter_cache_bytes: int = 2 << 30
    adapter_read_bytes_per_second: int = 0  # a cap on the disk read rate of an adapter load (a volume shared with
    # other engines); 0: none
    adapter_read_uncached: bool = False  # adapter loads read around the page cache (posix_fadvise DONTNEED): from
    # the disk every time, with no second copy beside the host tier
    enable_prefix_caching: bool = True
    kv_host_cache_gb: float = 0.0  # host memory (GiB) for prefix blocks evicted from the pool; 0: no host tier
    # (docs/kv-tiers.md; pinned on CUDA)
    long_prefill_token_threshold: int = 0  # 0: a prefill chunk may take the whole step budget
    # quantization (docs/quantization.md)
    quantization: str | None = None  # None, "int8" (weight-only) or "fp8" (E4M3 weights and activations)
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) or "fp8" (E4M3 pages, a scale per token and head)
    # speculative decoding (docs/speculative.md)
    speculative_method: str | None = None  # None, "ngram" or "draft"
    num_speculative_tokens: int = 4  # tokens proposed per sequence and step
    speculative_model: str | None = None  # draft checkpoint directory ("draft"; same tokenizer as the model)
    speculative_max_batch: int = 32  # steps with more running sequences do not speculate (compute-bound)
    speculative_min_acceptance: float = 0.3  # a sequence whose acceptance rate falls below this stops proposing
    tensor_parallel_size: int = 1  # ranks the model is split over (docs/tensor-parallel.md); 1: no workers
    cuda_graphs: bool = True  # CUDA: decode steps replay CUDA graphs per padded batch size (docs/gpu.md); off
    # (--no-cuda-graphs): every step eager. Ignored on CPU, which runs eagerly
    role: str = "both"  # "prefill", "decode" or "both": what the gateway sends here (docs/kv-tiers.md)

    def __post_init__(self) -> None:
        if not Path(self.model).is_dir():
            raise ValueError(f"model directory not found: {self.model}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        self._map_deprecated()
        positive = ("max_num_batched_tokens", "max_num_seqs", "pool_adapters_at_max_rank", "max_adapter_rank")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")
        if self.kv_landing_bytes < 0:
            raise ValueError("kv_landing_bytes must be >= 0")
        if self.pool_adapter_bytes is not None and self.pool_adapter_bytes < 0:
            raise ValueError("pool_adapter_bytes must be >= 0")
        if self.host_adapter_cache_bytes < 0:
            raise ValueError("host_adapter_cache_bytes must be >= 0")
        if self.adapter_read_bytes_per_second < 0:
            raise ValueError("adapter_read_bytes_per_second must be >= 0")
        if self.kv_host_cache_gb < 0:
            raise ValueError("kv_host_cache_gb must be >= 0")
        if self.kv_host_cache_gb and not self.enable_prefix_caching:
            raise ValueError("kv_host_cache_gb needs prefix caching: the host tier keeps evicted prefix blocks")
        if self.kv_host_cache_gb and self.tensor_parallel_size > 1:
            raise ValueError("kv_host_cache_gb is not supported with tensor parallelism")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        self._validate_quantization()
        self._validate_speculative()
        # tensor parallelism (docs/tensor-parallel.md); the model's head counts are checked when it is loaded
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")

    def _map_deprecated(self) -> None:
        """The flags' former names, which did not say what they bound, set their new fields (with a warning)."""
        for old, new in DEPRECATED.items():
            value = getattr(self, old)
            if value is None:
                continue
            if getattr(self, new) != EngineConfig.__dataclass_fields__[new].default:
                raise ValueError(f"{old} is the deprecated name of {new}: give {new} alone")
            warnings.warn(f"{old} is deprecated: it is {new} (--{new.replace('_', '-')}), what it sizes in the one "
                          "page pool (docs/engine-memory.md)", FutureWarning, stacklevel=3)
            setattr(self, new, value)
            setattr(self, old, None)

    def _validate_quantization(self) -> None:
        if self.quantization in ("", "none"):
            self.quantization = None
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or none, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")

    def _validate_speculative(self) -> None:
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {SPECULATIVE_METHODS}, got {self.speculative_method!r}")
        if self.speculative_method is None:
            return
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 with speculation on, got {self.num_speculative_tokens}")
        if self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.speculative_max_batch}")
        if not 0.0 <= self.speculative_min_acceptance <= 1.0:
            raise ValueError("speculative_min_acceptance must be in [0, 1]")
        if self.speculative_method == "draft":
            if self.speculative_model is None:
                raise ValueError("speculative_method 'draft' needs speculative_model (a draft checkpoint directory)")
            if not Path(self.speculative_model).is_dir():
                raise ValueError(f"speculative_model directory not found: {self.speculative_model}")
        elif self.speculative_model is not None:
            raise ValueError("speculative_model is only used with speculative_method 'draft'")
