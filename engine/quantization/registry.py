"""Which module serves each pre-quantized checkpoint scheme: the one place the loader asks.

A format family is one module beside this one that subclasses PackedLinear; it is listed here under its
QuantSpec.scheme. Anything else is refused at start, by name, with the list of what is served."""

from engine.quantization.awq import AWQLinear
from engine.quantization.compressed_tensors import NaiveQuantizedLinear, PackQuantizedLinear
from engine.quantization.fp8 import CompressedFp8Linear, Fp8BlockLinear
from engine.quantization.gptq import GPTQLinear
from engine.quantization.packed_linear import PackedLinear
from engine.quantization.spec import QuantSpec, read_quant_spec

FORMATS: dict[str, type[PackedLinear]] = {
    "gptq": GPTQLinear,
    "awq": AWQLinear,
    "compressed-tensors:pack-quantized": PackQuantizedLinear,
    "compressed-tensors:naive-quantized": NaiveQuantizedLinear,
    "compressed-tensors:float-quantized": CompressedFp8Linear,
    "fp8": Fp8BlockLinear,
}


def format_for(spec: QuantSpec) -> type[PackedLinear]:
    """The PackedLinear class serving `spec`, its settings checked; ValueError naming the scheme and listing the
    served ones otherwise."""
    cls = FORMATS.get(spec.scheme)
    if cls is None:
        raise ValueError(f"quantization {spec.scheme!r} (quantization_config in config.json) is not supported; "
                         f"supported: {', '.join(FORMATS)}")
    cls.check_spec(spec)
    return cls


def checkpoint_quantization(config: dict, *, quantization: str | None) -> QuantSpec | None:
    """The spec of a checkpoint's config.json (None: full precision), checked at start: a scheme that is not
    served, settings the kernels lack, or a quantization on load asked of a quantized checkpoint is a ValueError."""
    spec = read_quant_spec(config)
    if spec is None:
        return None
    if quantization is not None:
        raise ValueError(f"quantization {quantization!r}: this checkpoint is already quantized ({spec.describe()}); "
                         f"--quantization quantizes a full-precision checkpoint on load")
    format_for(spec)
    return spec
