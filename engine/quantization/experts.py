"""The experts of an MoE layer read from a pre-quantized checkpoint (GPTQ / AWQ / compressed-tensors experts of
Qwen3-MoE, Qwen2-MoE, Mixtral).

While loading, each expert's fused gate/up and its down are their format's PackedLinear (experts.gate_up_proj.{e},
experts.down_proj.{e}: MoECausalLM.checkpoint_target sends each stored tensor there); `stack()` then stacks their
kernel tensors into [E, ...] and drops the per-expert modules. The forward is engine.models.moe.Experts' (routing,
expert-sorted rows, each row's LoRA delta: engine/models/prequantized.py serves this class as an Experts) with
kernels.wna16_grouped_matmul for the two grouped products."""

import torch
from torch import nn

import kernels
from engine.quantization.int_linear import IntLinear
from engine.quantization.spec import QuantSpec

KINDS = ("qweight", "scales", "zeros", "g_idx")  # IntLinear's kernel tensors


class PackedExperts(nn.Module):
    packed_experts = True  # MoECausalLM.checkpoint_target routes the experts' stored tensors to each expert

    def __init__(self, base: nn.Module, packed_cls: type[IntLinear], spec: QuantSpec, *, name: str,
                 dtypes: dict[str, dict[str, torch.dtype]], linear: type[nn.Module], tp_size: int = 1) -> None:
        """base: the Experts it replaces (on meta: this rank's slice of every expert's intermediate); dtypes: for
        "gate_up_proj" and "down_proj", each stored kind's; linear: the model's Linear(in_features, out_slices,
        bias=), each expert's projection as the format's PackedLinear replaces it. Under tensor parallelism gate/up
        are column-parallel and down row-parallel, as the dense MLP's."""
        nn.Module.__init__(self)
        if not issubclass(packed_cls, IntLinear):
            raise ValueError(f"{spec.describe()}: PackedExperts stacks the integer formats' experts; a float format "
                             f"serves its experts with its own experts_cls")
        self.num_experts, self.inter, self.bits = base.num_experts, base.inter, spec.bits
        self.act_and_mul = base.act_and_mul
        self.model_dtype = base.gate_up_proj.dtype
        hidden = base.gate_up_proj.shape[2]
        with torch.device("meta"):
            gate_up = [packed_cls(linear(hidden, [self.inter, self.inter], bias=False), spec,
                                  name=f"{name}.gate_up_proj.{e}", dtypes=dtypes["gate_up_proj"], tp_size=tp_size)
                       for e in range(self.num_experts)]
            down = [packed_cls(linear(self.inter, [hidden], bias=False), spec, name=f"{name}.down_proj.{e}",
                               dtypes=dtypes["down_proj"], tp_size=tp_size, row_parallel=True)
                    for e in range(self.num_experts)]
        self.gate_up_proj, self.down_proj = nn.ModuleList(gate_up), nn.ModuleList(down)
        self.hidden = hidden

    def stack(self) -> None:
        """Every expert is loaded and finished: stack their kernel tensors, [E, ...] per kind and projection."""
        self.group_sizes = {}
        for projection in ("gate_up_proj", "down_proj"):
            experts = getattr(self, projection)
            sizes = {e.group_size for e in experts}
            self.group_sizes[projection] = sizes.pop() if len(sizes) == 1 else 0  # 0: each expert's own g_idx
            stacked = {kind: torch.stack([getattr(e, kind) for e in experts]) for kind in KINDS}
            perms = [e.perm for e in experts]
            if self.group_sizes[projection] and all(p is not None for p in perms):  # act order, sorted at load
                stacked["perm"] = torch.stack(perms)  # [E, in]
            elif any(p is not None for p in perms):  # some experts sorted, some not: gather by g_idx for all
                raise ValueError(f"{experts[0].name}: experts of one layer quantized with and without act order")
            delattr(self, projection)
            for kind, tensor in stacked.items():
                self.register_buffer(f"{projection}_{kind}", tensor.contiguous())
            if "perm" not in stacked:
                setattr(self, f"{projection}_perm", None)

    def project(self, projection: str, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        tensors = [getattr(self, f"{projection}_{kind}") for kind in KINDS]
        return kernels.wna16_grouped_matmul(rows, *tensors, offsets, self.bits,
                                            group_size=self.group_sizes[projection],
                                            perm=getattr(self, f"{projection}_perm"))

    def full_precision_bytes(self) -> int:
        return 3 * self.num_experts * self.inter * self.hidden * self.model_dtype.itemsize
