"""FP8 checkpoints: float8_e4m3fn weights with float32 scales, held as stored (never dequantized at load).

- `fp8` with `weight_block_size` [128, 128] (Qwen3-FP8, DeepSeek-V3; transformers' finegrained_fp8): per
  projection `weight` [out, in] F8_E4M3 and `weight_scale_inv` [cdiv(out, 128), cdiv(in, 128)] F32; the weight
  is `weight * weight_scale_inv[o // 128, i // 128]` (the name is the writer's: it multiplies). GPTQModel's
  FP8Config writes the same tensors with `weight_scale_semantics: "inverse"`: the weight is `weight /
  weight_scale_inv`, so its scales are held as their reciprocals (computed once, at load). Served
  weight-only: the activations stay in their dtype and `kernels.fp8_block_linear` dequantizes tiles in
  registers (docs/quantization.md says why the writer's per-group activation quantization is not applied).
- compressed-tensors `float-quantized` (llm-compressor's FP8 and FP8_DYNAMIC): `weight` [out, in] F8_E4M3,
  `weight_scale` [1] (strategy tensor) or [out, 1] (channel), and with static activations `input_scale` [1]. The
  activations are quantized as the checkpoint says, dynamic per token or with the static scale, and the
  product is `kernels.fp8_linear` (torch._scaled_mm on CUDA; on CPU compressed-tensors' own op order, so the
  same input gives its bits); a checkpoint without input_activations is weight-only, as above.
- An MoE's experts: each format's `experts_cls` (fp8_experts.py, compressed_fp8_experts.py).

Scales are held per output row, [out, groups] float32: a block's scale repeated over its 128 rows, a tensor's
over all of them. So a fused projection's slices (q/k/v, gate/up) need not end on a block, and a
column-parallel shard may cut a block (each rank takes its rows' scales); a row-parallel shard must start
on a block of input columns, else it is refused at start."""

from itertools import pairwise

import torch
from torch import nn

import kernels
from engine.context import Context
from engine.quantization.compressed_fp8_experts import CompressedFp8Experts
from engine.quantization.fp8_experts import BLOCK, Fp8Experts, cdiv
from engine.quantization.packed_linear import PackedLinear, TensorLayout
from engine.quantization.spec import QuantSpec, activation_mode, input_activations
from kernels.reference import FP8

WHOLE = TensorLayout(out_dim=None, in_dim=None)  # read whole by every rank; load_slice takes the rank's part


class Fp8Linear(PackedLinear):
    """The parts both fp8 formats share: the fp8 weight, scales per row and group of columns, the shard's rows."""

    scale_kind: str  # the scales' stored kind
    group_k: int  # input columns per scale
    rows_per_scale: int  # output rows per stored row of scales (a scale per tensor: all of them)

    def check_fp8(self, dtypes: dict[str, torch.dtype]) -> None:
        if dtypes.get("weight") != FP8:
            raise ValueError(f"{self.name}: {self.spec.describe()} stores weight in float8_e4m3fn, the checkpoint "
                             f"has {dtypes.get('weight')}")

    def slice_rows(self, index: int) -> tuple[int, range]:
        """(the slice's output rows as written, this rank's rows of them)."""
        width = self.out_slices[index]
        if self.row_parallel or self.tp_size == 1:
            return width, range(width)
        return width * self.tp_size, range(self.tp_rank * width, (self.tp_rank + 1) * width)

    def column_groups(self) -> slice:
        """This rank's groups of the stored scales' columns (a row-parallel shard starts on a group: checked)."""
        if not self.row_parallel or self.tp_size == 1:
            return slice(None)
        first = self.tp_rank * self.in_features // self.group_k
        return slice(first, first + cdiv(self.in_features, self.group_k))

    def check_row_parallel_shard(self) -> None:
        if self.row_parallel and self.tp_size > 1 and self.in_features % self.group_k:
            raise ValueError(f"{self.name}: tensor_parallel_size {self.tp_size} gives each rank {self.in_features} "
                             f"of its {self.in_total} input columns, which splits a block of {self.group_k} columns "
                             f"that share a scale; {self.spec.describe()} needs each rank's input columns to be a "
                             f"multiple of {self.group_k}")

    def load_scale_rows(self, index: int, tensor: torch.Tensor, expected: tuple[int, int], rows_per_scale: int
                        ) -> None:
        """Copy this rank's rows of slice `index`'s stored scales [expected], each stored row standing for
        `rows_per_scale` output rows, into the [out, groups] float32 scales."""
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{self.name}: {self.scale_kind} of slice {index} has shape {tuple(tensor.shape)}, "
                             f"expected {expected} for {self.spec.describe()}")
        _, rows = self.slice_rows(index)
        per_row = torch.arange(rows.start, rows.stop) // rows_per_scale  # [rows] each row's stored scale row
        o0, o1 = self.slice_offsets[index], self.slice_offsets[index + 1]
        getattr(self, self.scale_kind).data[o0:o1].copy_(tensor[per_row][:, self.column_groups()])

    def load_fused(self, kind: str, tensor: torch.Tensor) -> None:
        """A fused projection's scales as stored fused: a stored row of them may stand for the last rows of one
        slice and the first of the next (a block of 128 holding q's end and k's start), so they are spread to
        one row per output row, then each slice takes its rows."""
        if kind != self.scale_kind or tensor.numel() == 1:
            return super().load_fused(kind, tensor)
        scales = tensor.reshape(-1, 1) if tensor.dim() == 1 else tensor  # [stored rows, groups]
        written = [width * self.tp_size for width in self.out_slices]  # each slice's output rows, as written
        expected = (cdiv(sum(written), self.rows_per_scale), cdiv(self.in_total, self.group_k))
        if tuple(scales.shape) != expected:
            raise ValueError(f"{self.name}: fused {kind} has shape {tuple(tensor.shape)}, expected {expected} for "
                             f"{self.spec.describe()}")
        per_row = scales.repeat_interleave(self.rows_per_scale, dim=0)[: sum(written)]  # [out as written, groups]
        for index, rows in enumerate(per_row.split(written)):
            self.load_scale_rows(index, rows, (written[index], expected[1]), 1)

    def finish(self) -> None:
        scales = getattr(self, self.scale_kind).data
        if not torch.isfinite(scales).all() or not (scales > 0).all():
            raise ValueError(f"{self.name}: {self.scale_kind} holds scales that are not positive and finite")
        setattr(self, self.scale_kind, nn.Parameter(scales.float().contiguous(), requires_grad=False))

    def weight_only(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.fp8_block_linear(x, self.weight, getattr(self, self.scale_kind), self.group_k)  # [T, out]


class Fp8BlockLinear(Fp8Linear):
    """quant_method "fp8" with weight_block_size [128, 128]."""

    marker = "weight_scale_inv"
    scale_kind = "weight_scale_inv"
    group_k = BLOCK
    rows_per_scale = BLOCK
    experts_cls = Fp8Experts  # an MoE checkpoint's experts in this format

    @classmethod
    def check_spec(cls, spec: QuantSpec) -> None:
        block = spec.weight_block_size
        if block is None:
            raise ValueError("quantization 'fp8' without weight_block_size (per-tensor fp8 checkpoints) is not "
                             "served; served: weight_block_size [128, 128], or compressed-tensors float-quantized")
        if tuple(block) != (BLOCK, BLOCK):
            raise ValueError(f"quantization 'fp8': weight_block_size {list(block)} is not served; the kernel takes "
                             f"[{BLOCK}, {BLOCK}]")
        if spec.activation_scheme not in (None, "dynamic"):
            raise ValueError(f"quantization 'fp8': activation_scheme {spec.activation_scheme!r} is not served with "
                             f"weight_block_size; served: 'dynamic'")
        if spec.format not in ("e4m3", ""):
            raise ValueError(f"quantization 'fp8': fmt {spec.format!r} is not served; served: e4m3")

    @classmethod
    def layouts(cls, spec: QuantSpec) -> dict[str, TensorLayout]:
        return {"weight": TensorLayout(out_dim=0, in_dim=1), "weight_scale_inv": WHOLE}

    def stored(self) -> dict[str, tuple[int, ...]]:
        self.check_row_parallel_shard()
        return {"weight": (self.out_features, self.in_features),
                "weight_scale_inv": (self.out_features, cdiv(self.in_features, BLOCK))}  # held per row

    def __init__(self, base, spec: QuantSpec, *, name: str, dtypes: dict[str, torch.dtype], **shard) -> None:
        super().__init__(base, spec, name=name, dtypes=dtypes, **shard)
        self.check_fp8(dtypes)

    def load_slice(self, index: int, kind: str, tensor: torch.Tensor) -> None:
        if kind != "weight_scale_inv":
            return super().load_slice(index, kind, tensor)
        width, _ = self.slice_rows(index)
        self.load_scale_rows(index, tensor, (cdiv(width, BLOCK), cdiv(self.in_total, BLOCK)), BLOCK)

    def finish(self) -> None:
        super().finish()
        if self.spec.inverse_scales:  # GPTQModel's: the weight is weight / weight_scale_inv; held as the scale
            self.weight_scale_inv.data = torch.reciprocal(self.weight_scale_inv.data)

    def forward(self, x: torch.Tensor, ctx: Context | None = None) -> torch.Tensor:
        y = self.weight_only(x)
        return y if self.bias is None else y + self.bias


class CompressedFp8Linear(Fp8Linear):
    """compressed-tensors float-quantized: weights per tensor or per channel, activations dynamic per token,
    static per tensor, or not quantized."""

    marker = "weight_scale"
    scale_kind = "weight_scale"
    rows_per_scale = 1  # strategy channel (a per-tensor scale is every slice's: PackedLinear.load_fused)

    experts_cls = CompressedFp8Experts  # an MoE checkpoint's experts in this format

    @classmethod
    def check_spec(cls, spec: QuantSpec) -> None:
        if spec.weight_type != "float" or spec.bits != 8:
            raise ValueError(f"{spec.scheme}: {spec.bits}-bit {spec.weight_type} weights; float-quantized is served "
                             f"for 8-bit float (FP8) weights")
        if not spec.symmetric:  # a float weight_zero_point: not stored by the presets, not read here
            raise ValueError(f"{spec.scheme}: quantization_config weights symmetric false is not served; served: "
                             f"symmetric fp8 weights (no zero point)")
        if spec.strategy not in ("tensor", "channel"):
            raise ValueError(f"{spec.scheme}: weight strategy {spec.strategy!r} is not served; served: tensor, "
                             f"channel (and block scales as quantization 'fp8' with weight_block_size)")
        if spec.activation_bits not in (0, 8) or activation_mode(spec) not in (None, "token", "tensor"):
            raise ValueError(f"{spec.scheme}: input activations {input_activations(spec)} are not served; served: "
                             f"none, 8-bit float dynamic per token, 8-bit float static per tensor")

    @classmethod
    def layouts(cls, spec: QuantSpec) -> dict[str, TensorLayout]:
        shapes = {"weight": TensorLayout(out_dim=0, in_dim=1), "weight_scale": WHOLE}
        if activation_mode(spec) == "tensor":
            shapes["input_scale"] = WHOLE
        return shapes

    @property
    def group_k(self) -> int:
        return self.in_features  # one scale per row

    def stored(self) -> dict[str, tuple[int, ...]]:
        shapes = {"weight": (self.out_features, self.in_features), "weight_scale": (self.out_features, 1)}
        if activation_mode(self.spec) == "tensor":
            shapes["input_scale"] = (len(self.out_slices),)  # one per slice: q, k and v were calibrated apart
        return shapes

    def __init__(self, base, spec: QuantSpec, *, name: str, dtypes: dict[str, torch.dtype], **shard) -> None:
        super().__init__(base, spec, name=name, dtypes=dtypes, **shard)
        self.check_fp8(dtypes)
        self.activations = activation_mode(spec)

    def column_groups(self) -> slice:
        return slice(None)

    def load_slice(self, index: int, kind: str, tensor: torch.Tensor) -> None:
        width, _ = self.slice_rows(index)
        if kind == "weight_scale":
            if self.spec.strategy == "tensor":  # one scale [1] (or []): every row's
                if tensor.numel() != 1:
                    raise ValueError(f"{self.name}: weight_scale of slice {index} has shape {tuple(tensor.shape)}; "
                                     f"strategy 'tensor' stores one scale")
                return self.load_scale_rows(index, tensor.reshape(1, 1), (1, 1), width)
            per_row = tensor.reshape(-1, 1) if tensor.dim() == 1 else tensor  # [out, 1] (or [out])
            return self.load_scale_rows(index, per_row, (width, 1), 1)
        if kind == "input_scale":
            if tensor.numel() != 1:
                raise ValueError(f"{self.name}: input_scale of slice {index} has shape {tuple(tensor.shape)}; static "
                                 f"per-tensor activations store one scale")
            self.input_scale.data[index] = tensor.reshape(())
            return None
        return super().load_slice(index, kind, tensor)

    def finish(self) -> None:
        super().finish()
        if self.activations == "tensor":
            scales = self.input_scale.data.float()
            if not torch.isfinite(scales).all() or not (scales > 0).all():
                raise ValueError(f"{self.name}: input_scale holds scales that are not positive and finite")
            self.input_scale = nn.Parameter(scales.contiguous(), requires_grad=False)
        on_cuda = self.weight.is_cuda and self.activations is not None
        if on_cuda and (self.in_features % 16 or any(width % 16 for width in self.out_slices)):
            raise ValueError(f"{self.name}: fp8 activations need in and out features that are multiples of 16 on "
                             f"CUDA (torch._scaled_mm), got {self.in_features} and {self.out_slices}")

    def forward(self, x: torch.Tensor, ctx: Context | None = None) -> torch.Tensor:
        if self.activations is None:
            y = self.weight_only(x)
        elif self.activations == "token":
            y = kernels.fp8_linear(x, self.weight, self.weight_scale[:, 0])  # [T, out]
        else:  # static: each slice's activations with that slice's calibrated scale
            y = torch.cat([kernels.fp8_linear(x, self.weight[o0:o1], self.weight_scale[o0:o1, 0],
                                              self.input_scale[i : i + 1])
                           for i, (o0, o1) in enumerate(pairwise(self.slice_offsets))], dim=-1)
        return y if self.bias is None else y + self.bias
