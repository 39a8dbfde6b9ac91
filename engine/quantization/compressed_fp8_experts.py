"""A compressed-tensors float-quantized checkpoint's experts (llm-compressor's FP8 and FP8_DYNAMIC schemes on
Qwen3-MoE, Qwen2-MoE, Mixtral): each expert's gate, up and down projections stored as `weight` F8_E4M3 with
`weight_scale` per tensor [1] or per channel [out, 1], and with static activations `input_scale` [1].

Held as Fp8Experts holds the block format's, in fp8 with float32 scales per row ([E, rows, 1]: a tensor's scale
repeated over its rows), and each grouped product is `kernels.grouped_matmul` with the weights dequantized in
registers. The rows entering each product are quantized as the checkpoint says, as compressed-tensors' forward
does it (kernels.reference.fake_quantize_fp8): dynamic per token (the row's absolute maximum / 448) or with the
expert's calibrated static scale; the dequantized fp8 rows then go through the product. gate and up read the same
rows, so one static scale serves both: a checkpoint whose gate and up scales differ is refused at start.

Under tensor parallelism each rank holds its rows of gate and up (their per-channel scales sharded with them)
and its columns of down; per-row scales never split a group, so any shard that divides the intermediate works."""

import torch
from torch import nn

from engine.quantization.fp8_experts import Fp8Experts, check_scales, param
from engine.quantization.spec import QuantSpec, activation_mode
from kernels.reference import fake_quantize_fp8


class CompressedFp8Experts(Fp8Experts):
    stacked_kinds = {"weight": "", "weight_scale": "_scale", "input_scale": "_input_scale"}  # MoECausalLM's routing
    column_blocks = False  # one scale a row: any shard of down's columns

    def __init__(self, base: nn.Module, spec: QuantSpec, *, name: str, tp_rank: int, tp_size: int) -> None:
        self.group_k = max(base.gate_up_proj.shape[2], base.inter)  # covers every input column: one scale a row
        super().__init__(base, spec, name=name, tp_rank=tp_rank, tp_size=tp_size)
        self.strategy, self.activations = spec.strategy, activation_mode(spec)
        if self.activations == "tensor":  # per expert; gate's and up's apart until finish() checks they agree
            self.gate_up_proj_input_scale = param(self.num_experts, 2, dtype=torch.float32)
            self.down_proj_input_scale = param(self.num_experts, dtype=torch.float32)

    def load_slice(self, index: int, kind: str, tensor: torch.Tensor) -> None:
        """gate_up_proj[_scale, _input_scale] piece 2e (gate) or 2e + 1 (up), down_proj[...] piece e: weights and
        per-channel scales as this rank's rows, a per-tensor scale and input scales whole."""
        if kind in ("gate_up_proj", "down_proj"):
            return self.load_weight(index, kind, tensor)
        expert, part = divmod(index, 2) if kind.startswith("gate_up_proj") else (index, 0)
        projection = "gate_up_proj" if kind.startswith("gate_up_proj") else "down_proj"
        if kind.endswith("_input_scale"):
            if tensor.numel() != 1:
                raise ValueError(f"{self.name}: expert {expert} input_scale of {projection} has shape "
                                 f"{tuple(tensor.shape)}; static per-tensor activations store one scale")
            getattr(self, kind).data[(expert, part) if projection == "gate_up_proj" else expert] = tensor.reshape(())
            return None
        if kind != f"{projection}_scale":
            raise ValueError(f"{self.name}: unexpected {kind} for compressed-tensors fp8 experts")
        target = self.gate_up_proj_scale.data[expert, part * self.inter : (part + 1) * self.inter, 0] \
            if projection == "gate_up_proj" else self.down_proj_scale.data[expert, :, 0]
        expected = (1,) if self.strategy == "tensor" else (target.shape[0], 1)
        if tuple(tensor.shape) != expected and not (self.strategy == "tensor" and tensor.numel() == 1):
            raise ValueError(f"{self.name}: expert {expert} weight_scale of {projection} has shape "
                             f"{tuple(tensor.shape)}, expected {expected} (strategy {self.strategy!r})")
        target.copy_(tensor.float().reshape(-1).expand(target.shape[0]))
        return None

    def finish(self) -> None:
        super().finish()
        if self.activations != "tensor":
            return
        gate_up = self.gate_up_proj_input_scale.data
        check_scales(self.name, "input_scale", gate_up)
        check_scales(self.name, "input_scale", self.down_proj_input_scale.data)
        differ = (gate_up[:, 0] != gate_up[:, 1]).nonzero().flatten().tolist()
        if differ:
            raise ValueError(f"{self.name}: experts {differ} have gate and up input_scale that differ; both read "
                             f"the same rows, which are quantized once with one static scale")
        self.gate_up_proj_input_scale = torch.nn.Parameter(gate_up[:, 0].contiguous(), requires_grad=False)

    def project(self, projection: str, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if self.activations == "token":
            rows = fake_quantize_fp8(rows)
        elif self.activations == "tensor":  # each row with its expert's scale
            positions = torch.arange(rows.shape[0], device=rows.device, dtype=offsets.dtype)
            experts = torch.searchsorted(offsets[1:].contiguous(), positions, right=True)  # [N]; no host sync
            rows = fake_quantize_fp8(rows, getattr(self, f"{projection}_input_scale")[experts])
        return super().project(projection, rows, offsets)
