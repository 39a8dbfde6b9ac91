"""Which projections carry LoRA, how the model fuses them, and their widths: declared once, here.

The model fuses q/k/v into qkv_proj and gate/up into gate_up_proj; an adapter still has each
checkpoint module at its own rank. Module index i (PROJECTIONS order) is the i-th column of every
per-adapter table (ranks, scalings, page rows)."""

from adapters.base_shapes import PROJECTIONS, BaseShapes
from engine.parallel.sharding import ROW_PARALLEL

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


def row_widths(shapes: BaseShapes, *, tensor_parallel_size: int = 1) -> list[tuple[int, int]]:
    """Per module index: (width of an A row = in_features, width of a B-transposed row = out_features), of one
    rank's shard under tensor parallelism: row-parallel modules split A's rows, the others B's (sharding)."""
    size, widths = tensor_parallel_size, []
    for module in PROJECTIONS:
        width_in, width_out = shapes.in_out(module)
        widths.append((width_in // size, width_out) if module in ROW_PARALLEL else (width_in, width_out // size))
    return widths
