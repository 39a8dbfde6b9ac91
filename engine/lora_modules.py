"""Which projections carry LoRA, how the model fuses them, and their widths: declared once, here.

The model fuses q/k/v into qkv_proj and gate/up into gate_up_proj; an adapter still has each
checkpoint module at its own rank. Module index i (PROJECTIONS order) is the i-th column of every
per-adapter table (ranks, scalings, page rows)."""

from adapters.base_shapes import PROJECTIONS, BaseShapes

PACKED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
MODULE_INDEX = {module: i for i, module in enumerate(PROJECTIONS)}


def first_index(fused: str) -> int:
    """Module index of a fused projection's first slice (its slices are consecutive)."""
    return MODULE_INDEX[PACKED_MODULES[fused][0]]


def row_widths(shapes: BaseShapes) -> list[tuple[int, int]]:
    """Per module index: (width of an A row = in_features, width of a B-transposed row = out_features)."""
    return [shapes.in_out(module) for module in PROJECTIONS]
