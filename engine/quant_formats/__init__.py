"""Serving checkpoints that were quantized before they were downloaded (GPTQ, AWQ, compressed-tensors, fp8):
read `quantization_config` (spec.py), pick the format's module (registry.py), load each projection's tensors as
stored (packed_linear.py) and serve them with their kernel. docs/quantization.md gives the rules."""

from engine.quant_formats.packed_linear import PackedLinear, TensorLayout, shard_index
from engine.quant_formats.registry import FORMATS, checkpoint_quantization, format_for
from engine.quant_formats.spec import QuantSpec, read_quant_spec

__all__ = ["FORMATS", "PackedLinear", "QuantSpec", "TensorLayout", "checkpoint_quantization", "format_for", "read_quant_spec", "shard_index"]
