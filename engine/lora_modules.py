"""Which projections carry LoRA, how the model fuses them, and their widths: declared once, here.

The model fuses q/k/v into qkv_proj and gate/up into gate_up_proj; an adapter still has each
checkpoint module at its own rank (a Phi-3 adapter on the fused names is split into its slices first,
`per_slice`). Module index i (MODULES order: PROJECTIONS, then the MoE experts' EXPERT_MODULES) is the i-th
column of every per-adapter table (ranks, scalings, page rows); Qwen2-MoE's shared expert has its own three, an
MoE layer's router one (replicated on every tensor-parallel rank, as the router is). An expert module's rank is each expert's; it has
E times as many rows (expert e's rows e*r .. e*r + r - 1)."""

import dataclasses

import torch

import adapters
from adapters.base_shapes import (
    EXPERT_MODULES,
    FUSED_PROJECTIONS,
    PROJECTIONS,
    ROUTER,
    SHARED_EXPERT_MODULES,
    BaseShapes,
)
from engine.parallel.sharding import ROW_PARALLEL

PACKED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
MODULES = PROJECTIONS + SHARED_EXPERT_MODULES + (ROUTER,) + EXPERT_MODULES
SHARED_EXPERT_PACKED = {"gate_up_proj": "shared_expert_gate_proj", "down_proj": "shared_expert_down_proj"}  # first
MODULE_INDEX = {module: i for i, module in enumerate(MODULES)}
EXPERT_INDEX = tuple(MODULE_INDEX[m] for m in EXPERT_MODULES)  # (experts_gate_up_proj, experts_down_proj)
# output slices of an expert module: gate_up's B rows are laid out as two slices, gate's then up's, each as wide
# as one half (a row of B transposed over both would be twice the widest dense row: more than a page chunk holds)
EXPERT_SLICES = {MODULE_INDEX["experts_gate_up_proj"]: 2, MODULE_INDEX["experts_down_proj"]: 1}


def first_index(fused: str) -> int:
    """Module index of a fused projection's first slice (its slices are consecutive)."""
    return MODULE_INDEX[PACKED_MODULES[fused][0]]


def row_widths(shapes: BaseShapes, *, tensor_parallel_size: int = 1) -> list[tuple[int, int]]:
    """Per module index: (width of an A row = in_features, width of a B-transposed row = out_features), of one
    rank's shard under tensor parallelism: row-parallel modules split A's rows, the others B's (sharding); the
    experts' gate_up: the width of one of its two output slices (EXPERT_SLICES); the experts' modules of a base
    without experts are (0, 0)."""
    size, widths = tensor_parallel_size, []
    for module in MODULES:
        if (module in (*EXPERT_MODULES, ROUTER) and not shapes.num_experts) or (
                module in SHARED_EXPERT_MODULES and not shapes.shared_expert_intermediate_size):
            widths.append((0, 0))
            continue
        width_in, width_out = shapes.in_out(module)
        width_out //= EXPERT_SLICES.get(MODULE_INDEX[module], 1)
        if module == ROUTER:  # replicated
            widths.append((width_in, width_out))
            continue
        widths.append((width_in // size, width_out) if module in ROW_PARALLEL else (width_in, width_out // size))
    return widths


def per_slice(adapter: "adapters.LoadedAdapter", shapes: BaseShapes) -> "adapters.LoadedAdapter":
    """The adapter with every fused-name module (Phi-3's qkv_proj, gate_up_proj) replaced by its slices.

    A fused module's delta is scaling * B @ A x with one A [r, in] and B [sum of slice widths, r]; slice s of
    it is scaling * B_s @ A x where B_s is B's rows of that slice. So every slice keeps the whole A, its rows
    of B, the module's rank and scaling, and the sum over slices is exactly PEFT's delta on the fused layer.
    A module the base's family does not have is refused (AdapterError naming the module and the family).
    The digest is unchanged: it is the same adapter, laid out for the engine's per-slice tables."""
    shapes.check_modules(set(adapter.ranks))
    if not any(key.rsplit(".", 1)[-1] in FUSED_PROJECTIONS for key in adapter.ranks):
        return adapter
    ranks, scaling, tensors = {}, {}, {}
    for key, rank in adapter.ranks.items():
        prefix, _, module = key.rpartition(".")
        a, b = adapter.tensors[f"{key}.lora_A"], adapter.tensors[f"{key}.lora_B"]  # [r, in], [out, r]
        slices = FUSED_PROJECTIONS.get(module, (module,))
        widths = [shapes.in_out(split)[1] for split in slices] if len(slices) > 1 else [b.shape[0]]
        for split, b_rows in zip(slices, torch.split(b, widths), strict=True):
            name = f"{prefix}.{split}"
            if name in ranks:
                raise adapters.AdapterError(
                    "module_conflict", f"the adapter adapts {name} both by its split and its fused name")
            ranks[name], scaling[name] = rank, adapter.scaling[key]
            tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"] = a, b_rows.contiguous()
    return dataclasses.replace(adapter, ranks=ranks, scaling=scaling, tensors=tensors)
