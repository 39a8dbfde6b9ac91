"""GPTQ checkpoints (AutoGPTQ, GPTQModel; `quant_method: gptq`), 4 or 8 bits.

Stored per projection: qweight [in / p, out] int32 (p = 32 / bits input channels per int32, the first in the
lowest bits), qzeros [G, out / p] int32 (packed along the outputs), scales [G, out] float16, g_idx [in] int32
(each input channel's group; with desc_act the channels are quantized in act order, so g_idx is any dealing of
them into groups). W = (q - z) * scale. GPTQModel's v1 format ("gptq", AutoGPTQ's) stores z - 1 (dequantized
as ((stored + 1) & mask)); its v2 ("gptq_v2") stores z."""

import torch

from engine.quantization.int_linear import IntLinear, check_int_spec
from engine.quantization.packed_linear import TensorLayout
from engine.quantization.spec import QuantSpec
from kernels.wna16_reference import unpack_cols

FORMATS = ("gptq", "gptq_v2")


class GPTQLinear(IntLinear):
    marker = "qweight"

    @classmethod
    def check_spec(cls, spec: QuantSpec) -> None:
        if spec.format not in FORMATS:
            raise ValueError(f"gptq: checkpoint format {spec.format!r} is not served; served: {', '.join(FORMATS)}")
        check_int_spec(spec)

    @classmethod
    def layouts(cls, spec: QuantSpec) -> dict[str, TensorLayout]:
        whole = spec.desc_act or spec.group_size == -1  # every rank reads every group
        return {"qweight": TensorLayout(out_dim=1, in_dim=0), "qzeros": TensorLayout(out_dim=1, in_dim=None if whole else 0),
                "scales": TensorLayout(out_dim=1, in_dim=None if whole else 0), "g_idx": TensorLayout(out_dim=None, in_dim=0)}

    def stored(self) -> dict[str, tuple[int, ...]]:
        self.check_shard()
        groups, out = self.num_groups(), self.out_features
        shapes = {"qweight": (self.in_features // self.pack, out), "qzeros": (groups, out // self.pack),
                  "scales": (groups, out)}
        if "g_idx" in self.stored_dtypes or self.spec.desc_act:
            shapes["g_idx"] = (self.in_features,)
        return shapes

    def canonical(self):
        bits = self.spec.bits
        zeros = unpack_cols(self.qzeros.data, bits)  # [G, out]
        if self.spec.format == "gptq":  # v1: z - 1 stored
            zeros = (zeros + 1) & ((1 << bits) - 1)
        g_idx = self.g_idx.data if "g_idx" in self._parameters else None
        if g_idx is not None and not self.spec.desc_act:  # in order: it must say so
            group = self.in_total if self.spec.group_size == -1 else self.spec.group_size
            first = 0 if not self.row_parallel else int(g_idx[0]) * group if g_idx.numel() else 0
            expected = (first + torch.arange(self.in_features, device=g_idx.device)) // group
            if not torch.equal(g_idx.long(), expected):
                raise ValueError(f"{self.name}: g_idx is not in order but desc_act is false")
            g_idx = None
        return self.qweight.data, self.scales.data, zeros, g_idx
