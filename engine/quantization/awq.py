"""AWQ checkpoints (AutoAWQ's "gemm" layout; `quant_method: awq`), 4 bits with zero points.

Stored per projection: qweight [in, out / 8] int32 packed along the outputs, qzeros [G, out / 8] int32 alike,
scales [G, out] float16. Within an int32 the eight outputs 8c .. 8c + 7 sit in AWQ's order: its i-th 4 bits hold
output 8c + AWQ_ORDER[i]. W = (q - z) * scale. Loading repacks q along the inputs (GPTQ's layout) and puts the
zeros in order; nothing is dequantized."""

import torch

from engine.quantization.int_linear import IntLinear, check_int_spec
from engine.quantization.packed_linear import TensorLayout
from engine.quantization.spec import QuantSpec
from kernels.wna16_reference import pack_rows, unpack_cols

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output each 4 bits of an int32 hold, lowest bits first
AWQ_REVERSE = tuple(AWQ_ORDER.index(i) for i in range(8))  # where output i's 4 bits are


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[rows, out / 8] int32 in AWQ's order -> [rows, out] int32 values in output order."""
    values = unpack_cols(packed, 4)  # [rows, out] in the order of the bits
    rows, cols = values.shape
    return values.reshape(rows, cols // 8, 8)[:, :, list(AWQ_REVERSE)].reshape(rows, cols)


class AWQLinear(IntLinear):
    marker = "qweight"

    @classmethod
    def check_spec(cls, spec: QuantSpec) -> None:
        if spec.format != "gemm":
            raise ValueError(f"awq: version {spec.format!r} is not served; served: gemm")
        if spec.symmetric:
            raise ValueError("awq: zero_point false is not served; served: AWQ with zero points (gemm)")
        check_int_spec(spec, bits=(4,))

    @classmethod
    def layouts(cls, spec: QuantSpec) -> dict[str, TensorLayout]:
        whole = spec.group_size == -1
        return {"qweight": TensorLayout(out_dim=1, in_dim=0), "qzeros": TensorLayout(out_dim=1, in_dim=None if whole else 0),
                "scales": TensorLayout(out_dim=1, in_dim=None if whole else 0)}

    def stored(self) -> dict[str, tuple[int, ...]]:
        self.check_shard()
        groups, out = self.num_groups(), self.out_features
        return {"qweight": (self.in_features, out // 8), "qzeros": (groups, out // 8), "scales": (groups, out)}

    def canonical(self):
        qweight = pack_rows(awq_unpack(self.qweight.data), 4)  # [in / 8, out]
        return qweight, self.scales.data, awq_unpack(self.qzeros.data), None
