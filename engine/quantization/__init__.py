"""Quantization, all of it: base weights quantized on load (on_load.py: int8, fp8), the KV cache's dtype and the
memory report (memory.py), and checkpoints quantized before they were downloaded (GPTQ, AWQ, compressed-tensors,
fp8): read `quantization_config` (spec.py), pick the format's module (registry.py), load each projection's tensors
as stored (packed_linear.py and a module per family) and serve them with their kernel.

It knows no model: a format's modules take the projection or experts they replace as any module with their sizes,
and engine/models (its loader, prequantized.py) puts them into a model. docs/quantization.md gives the rules."""

from engine.quantization.packed_linear import PackedLinear, TensorLayout, shard_index
from engine.quantization.registry import FORMATS, checkpoint_quantization, format_for
from engine.quantization.spec import QuantSpec, read_quant_spec

__all__ = ["FORMATS", "PackedLinear", "QuantSpec", "TensorLayout", "checkpoint_quantization", "format_for",
           "read_quant_spec", "shard_index"]
