"""compressed-tensors checkpoints with integer weights (llm-compressor's W4A16 / W8A16; `quant_method:
compressed-tensors`): the `pack-quantized` and `naive-quantized` formats, group or channel strategy.

pack-quantized stores per projection: weight_packed [out, in / p] int32 (p = 32 / bits input channels per int32,
the first in the lowest bits, each value offset by 2**(bits - 1) into the unsigned range), weight_scale
[out, G], weight_zero_point [out / p, G] int32 packed along the outputs with the same offset (asymmetric only),
weight_shape [2] (the unpacked [out, in]). naive-quantized: weight [out, in] int8 (signed), weight_scale
[out, G], weight_zero_point [out, G] int8 (asymmetric only). W = (q - z) * scale, z = 0 when symmetric. Loading
transposes into GPTQ's layout (the packed int32s are the same words) and offsets the zeros alike."""

import torch

from engine.quantization.int_linear import IntLinear, check_int_spec
from engine.quantization.packed_linear import TensorLayout
from engine.quantization.spec import QuantSpec, weight_args
from kernels.wna16_reference import pack_rows, unpack_rows


def _check_ct(spec: QuantSpec, bits: tuple[int, ...]) -> None:
    if spec.weight_type != "int" or spec.activation_bits:
        raise ValueError(f"{spec.scheme}: only weight-only integer schemes (W4A16, W8A16) are served with this "
                         f"format, got {spec.weight_type} weights, activations of {spec.activation_bits or 16} bits")
    if spec.strategy not in ("group", "channel"):
        raise ValueError(f"{spec.scheme}: strategy {spec.strategy!r} is not served; served: group, channel")
    if spec.desc_act:  # actorder "group" stores g_idx; "weight" (alias "static") only ordered the calibration
        raise ValueError(f"{spec.scheme}: quantization_config weights actorder {weight_args(spec).get('actorder')!r} "
                         f"(act order, g_idx stored) is not served; served: null, 'weight', 'static'")
    check_int_spec(spec, bits=bits)


class _CompressedTensorsInt(IntLinear):
    scale_kind = "weight_scale"

    def num_groups(self) -> int:
        return 1 if self.spec.strategy == "channel" else super().num_groups()

    def load_slice(self, index: int, kind: str, tensor: torch.Tensor) -> None:
        if kind == "weight_shape":  # the unpacked [out, in] of the slice, as written (before any sharding)
            width = self.out_slices[index] * (1 if self.row_parallel else self.tp_size)
            if tensor.tolist() != [width, self.in_total]:
                raise ValueError(f"{self.name}: weight_shape {tensor.tolist()} of slice {index}, expected "
                                 f"{[width, self.in_total]}")
            return
        super().load_slice(index, kind, tensor)

    def load_fused(self, kind: str, tensor: torch.Tensor) -> None:
        if kind == "weight_shape":  # the fused [out, in] as written
            width = self.out_features * self.tp_size
            if tensor.tolist() != [width, self.in_total]:
                raise ValueError(f"{self.name}: weight_shape {tensor.tolist()}, expected {[width, self.in_total]}")
            return
        super().load_fused(kind, tensor)

    def _zeros(self, groups: int) -> torch.Tensor:
        offset = 1 << (self.spec.bits - 1)
        return torch.full((groups, self.out_features), offset, dtype=torch.int32, device=self.weight_scale.device)


class PackQuantizedLinear(_CompressedTensorsInt):
    marker = "weight_packed"

    @classmethod
    def check_spec(cls, spec: QuantSpec) -> None:
        _check_ct(spec, (4, 8))

    @classmethod
    def layouts(cls, spec: QuantSpec) -> dict[str, TensorLayout]:
        whole = spec.strategy == "channel"
        return {"weight_packed": TensorLayout(out_dim=0, in_dim=1),
                "weight_scale": TensorLayout(out_dim=0, in_dim=None if whole else 1),
                "weight_zero_point": TensorLayout(out_dim=0, in_dim=None if whole else 1),
                "weight_shape": TensorLayout(out_dim=None, in_dim=None)}

    def stored(self) -> dict[str, tuple[int, ...]]:
        self.check_shard()
        groups, out = self.num_groups(), self.out_features
        shapes = {"weight_packed": (out, self.in_features // self.pack), "weight_scale": (out, groups)}
        if not self.spec.symmetric:
            shapes["weight_zero_point"] = (out // self.pack, groups)
        return shapes

    def canonical(self):
        scales = self.weight_scale.data.t()  # [G, out]
        if self.spec.symmetric:
            zeros = self._zeros(scales.shape[0])
        else:  # packed along the outputs, offset like the weights
            zeros = unpack_rows(self.weight_zero_point.data, self.spec.bits).t()  # [G, out]
        return self.weight_packed.data.t(), scales, zeros, None


class NaiveQuantizedLinear(_CompressedTensorsInt):
    marker = "weight_scale"

    @classmethod
    def check_spec(cls, spec: QuantSpec) -> None:
        _check_ct(spec, (8,))

    @classmethod
    def layouts(cls, spec: QuantSpec) -> dict[str, TensorLayout]:
        whole = spec.strategy == "channel"
        return {"weight": TensorLayout(out_dim=0, in_dim=1),
                "weight_scale": TensorLayout(out_dim=0, in_dim=None if whole else 1),
                "weight_zero_point": TensorLayout(out_dim=0, in_dim=None if whole else 1)}

    def stored(self) -> dict[str, tuple[int, ...]]:
        self.check_shard()
        groups, out = self.num_groups(), self.out_features
        shapes = {"weight": (out, self.in_features), "weight_scale": (out, groups)}
        if not self.spec.symmetric:
            shapes["weight_zero_point"] = (out, groups)
        return shapes

    def canonical(self):
        offset = 1 << (self.spec.bits - 1)
        qweight = pack_rows((self.weight.data.to(torch.int32) + offset).t(), self.spec.bits)  # [in / 4, out]
        scales = self.weight_scale.data.t()  # [G, out]
        if self.spec.symmetric:
            zeros = self._zeros(scales.shape[0])
        else:
            zeros = (self.weight_zero_point.data.to(torch.int32) + offset).t()
        return qweight, scales, zeros, None
