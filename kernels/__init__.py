"""Quilt's kernels: Triton on CUDA tensors, the plain-PyTorch references on CPU tensors.

`backend_for(tensor)` names the path an op takes for that tensor. There is no silent fallback:
a CUDA tensor without a working Triton raises instead of running the reference.

Each Triton launcher lives in kernels/<op>.py; `kernels.<op>` is the dispatching function (it is
defined after those modules are imported), so reach a launcher itself with
`importlib.import_module("kernels.<op>").<op>` (`import kernels.<op> as m` yields the function).
`kernels.interpreter.enable()` runs the launchers on CPU tensors through Triton's interpreter and
sends every op's CPU tensors to its launcher (`route_cpu_to_triton`).
"""

import torch

from kernels import fp8_linear as _fp8_linear
from kernels import reference
from kernels.decode_layout import DecodeLayout
from kernels.lora_meta import LoRAMeta
from kernels.rope_table import rope_cos_sin_cache
from kernels.slot_batch import SlotBatch

try:
    from kernels import expert_lora as _expert_lora
    from kernels import fp8_block_linear as _fp8_block_linear
    from kernels import gelu_tanh_and_mul as _gelu_tanh_and_mul
    from kernels import grouped_matmul as _grouped_matmul
    from kernels import lora_delta as _lora_delta
    from kernels import lora_expand as _lora_expand
    from kernels import lora_shrink as _lora_shrink
    from kernels import paged_attention_decode as _paged_attention_decode
    from kernels import paged_attention_prefill as _paged_attention_prefill
    from kernels import rms_norm as _rms_norm
    from kernels import rotary_embedding as _rotary_embedding
    from kernels import silu_and_mul as _silu_and_mul
    from kernels import store_kv as _store_kv
    from kernels import wna16_grouped_matmul as _wna16_grouped_matmul
    from kernels import wna16_linear as _wna16_linear

    TRITON_IMPORT_ERROR: ImportError | None = None
except ImportError as exc:  # triton absent: CPU tensors still work, CUDA tensors raise
    TRITON_IMPORT_ERROR = exc

__all__ = [
    "DecodeLayout",
    "LoRAMeta",
    "SlotBatch",
    "TRITON_IMPORT_ERROR",
    "backend_for",
    "decode_layout",
    "expert_lora",
    "fp8_block_linear",
    "fp8_linear",
    "gelu_tanh_and_mul",
    "grouped_matmul",
    "lora_delta",
    "lora_expand",
    "lora_meta",
    "lora_shrink",
    "paged_attention_decode",
    "paged_attention_prefill",
    "reference",
    "rms_norm",
    "rope_cos_sin_cache",
    "route_cpu_to_triton",
    "rotary_embedding",
    "silu_and_mul",
    "store_kv",
    "wna16_grouped_matmul",
    "wna16_linear",
]


_CPU_TO_TRITON = False  # kernels.interpreter.enable() sets it: CPU tensors go to the launchers too


def route_cpu_to_triton(enabled: bool) -> None:
    """Send CPU tensors to the Triton launchers (under Triton's interpreter: kernels.interpreter.enable()),
    or back to the references. fp8_linear is no Triton kernel and keeps its reference on CPU."""
    global _CPU_TO_TRITON
    _CPU_TO_TRITON = enabled


def backend_for(tensor: torch.Tensor) -> str:
    """"triton" for CUDA tensors (and CPU tensors while route_cpu_to_triton is on), "reference" otherwise;
    raises if CUDA arrives without Triton."""
    if not tensor.is_cuda and not _CPU_TO_TRITON:
        return "reference"
    if TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(f"CUDA tensor given but the Triton kernels failed to import: {TRITON_IMPORT_ERROR}")
    return "triton"


def lora_meta(token_slots: torch.Tensor, num_slots: int, *, previous: LoRAMeta | SlotBatch | None = None
              ) -> LoRAMeta | SlotBatch:
    """The grouping of a step's tokens by adapter slot that the backend of token_slots wants as `meta`:
    build it once per step and pass it to every lora_shrink / lora_expand of that step. previous: the meta of
    an earlier step over the same page-table tensors (other tokens), whose rows the references gathered from
    the pages are kept."""
    if backend_for(token_slots) == "triton":
        return LoRAMeta.build(token_slots, num_slots)
    return SlotBatch.build(token_slots, previous=previous if isinstance(previous, SlotBatch) else None)


def lora_delta(y, x, pages, a_rows, b_rows, token_slots, ranks, scaling, slice_offsets, *, meta=None, row_align=1):
    if backend_for(x) == "triton":
        return _lora_delta.lora_delta(y, x, pages, a_rows, b_rows, token_slots, ranks, scaling, slice_offsets,
                                      meta=meta, row_align=row_align)
    return reference.lora_delta(y, x, pages, a_rows, b_rows, token_slots, ranks, scaling, slice_offsets, meta=meta)


def lora_shrink(x, pages, a_rows, token_slots, ranks, *, meta: LoRAMeta | SlotBatch | None = None):
    if backend_for(x) == "triton":
        return _lora_shrink.lora_shrink(x, pages, a_rows, token_slots, ranks, meta=meta)
    return reference.lora_shrink(x, pages, a_rows, token_slots, ranks, meta=meta)


def lora_expand(y, buf, pages, b_rows, token_slots, ranks, scaling, slice_offsets, *,
                meta: LoRAMeta | SlotBatch | None = None):
    args = (y, buf, pages, b_rows, token_slots, ranks, scaling, slice_offsets)
    if backend_for(y) == "triton":
        return _lora_expand.lora_expand(*args, meta=meta)
    return reference.lora_expand(*args, meta=meta)


def gelu_tanh_and_mul(x):
    if backend_for(x) == "triton":
        return _gelu_tanh_and_mul.gelu_tanh_and_mul(x)
    return reference.gelu_tanh_and_mul(x)


def grouped_matmul(x, weight, expert_offsets, weight_scale=None, group_k=0):
    if backend_for(x) == "triton":
        return _grouped_matmul.grouped_matmul(x, weight, expert_offsets, weight_scale, group_k)
    return reference.grouped_matmul(x, weight, expert_offsets, weight_scale, group_k)


def expert_lora(y, x, pages, a_rows, b_rows, row_slots, row_experts, ranks, scaling, slice_offsets, *, meta=None):
    args = (y, x, pages, a_rows, b_rows, row_slots, row_experts, ranks, scaling, slice_offsets)
    if backend_for(x) == "triton":
        return _expert_lora.expert_lora(*args, meta=meta)
    return reference.expert_lora(*args, meta=meta)


def fp8_linear(x, weight, weight_scale, input_scale=None):
    if x.is_cuda:  # torch._scaled_mm, not Triton: no Triton needed
        return _fp8_linear.fp8_linear(x, weight, weight_scale, input_scale)
    return reference.fp8_linear(x, weight, weight_scale, input_scale)


def fp8_block_linear(x, weight, weight_scale, group_k):
    if backend_for(x) == "triton":
        return _fp8_block_linear.fp8_block_linear(x, weight, weight_scale, group_k)
    return reference.fp8_block_linear(x, weight, weight_scale, group_k)


def wna16_linear(x, qweight, scales, zeros, g_idx, bits, *, group_size=0, perm=None):
    op = _wna16_linear.wna16_linear if backend_for(x) == "triton" else reference.wna16_linear
    return op(x, qweight, scales, zeros, g_idx, bits, group_size=group_size, perm=perm)


def wna16_grouped_matmul(x, qweight, scales, zeros, g_idx, expert_offsets, bits, *, group_size=0, perm=None):
    op = _wna16_grouped_matmul.wna16_grouped_matmul if backend_for(x) == "triton" else reference.wna16_grouped_matmul
    return op(x, qweight, scales, zeros, g_idx, expert_offsets, bits, group_size=group_size, perm=perm)


def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scales=None, v_scales=None):
    args = (k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    if backend_for(k) == "triton":
        return _store_kv.store_kv(*args)
    return reference.store_kv(*args)


def decode_layout(block_tables: torch.Tensor, context_lens: torch.Tensor, k_cache: torch.Tensor
                  ) -> DecodeLayout | None:
    """What paged_attention_decode on the backend of k_cache wants as `meta` for a decode step: build it once
    per step and pass it to every layer's call (the reference's buckets of sequences; None for the launcher,
    which needs none)."""
    if backend_for(k_cache) == "triton":
        return None
    return DecodeLayout(block_tables, context_lens, k_cache.shape[1], k_cache.shape[0])


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale, k_scales=None, v_scales=None, *,
                           window=None, softcap=None, meta=None):
    args = (q, k_cache, v_cache, block_tables, context_lens, scale, k_scales, v_scales)
    if backend_for(q) == "triton":
        return _paged_attention_decode.paged_attention_decode(*args, window=window, softcap=softcap)
    return reference.paged_attention_decode(*args, window=window, softcap=softcap, meta=meta)


def paged_attention_prefill(q, k_cache, v_cache, cu_seqlens_q, block_tables, context_lens, scale, k_scales=None,
                            v_scales=None, *, window=None, softcap=None, key_limits=None):
    args = (q, k_cache, v_cache, cu_seqlens_q, block_tables, context_lens, scale, k_scales, v_scales)
    if backend_for(q) == "triton":
        return _paged_attention_prefill.paged_attention_prefill(*args, window=window, softcap=softcap,
                                                                key_limits=key_limits)
    return reference.paged_attention_prefill(*args, window=window, softcap=softcap, key_limits=key_limits)


def rms_norm(x, weight, eps, residual=None):
    if backend_for(x) == "triton":
        return _rms_norm.rms_norm(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def rotary_embedding(positions, q, k, cos_sin_cache):
    if backend_for(q) == "triton":
        return _rotary_embedding.rotary_embedding(positions, q, k, cos_sin_cache)
    return reference.rotary_embedding(positions, q, k, cos_sin_cache)


def silu_and_mul(x):
    if backend_for(x) == "triton":
        return _silu_and_mul.silu_and_mul(x)
    return reference.silu_and_mul(x)


for _op in (fp8_linear, fp8_block_linear, lora_delta, lora_shrink, lora_expand, store_kv, paged_attention_decode,
            paged_attention_prefill, rms_norm, rotary_embedding, silu_and_mul, gelu_tanh_and_mul, grouped_matmul,
            expert_lora, wna16_linear, wna16_grouped_matmul):
    _op.__doc__ = getattr(reference, _op.__name__).__doc__
del _op
