"""How the model and its adapters are split across tensor-parallel ranks (docs/tensor-parallel.md).

Column-parallel projections (q, k, v, gate, up) keep their input whole and split their outputs: rank i holds
heads i*H/N .. (i+1)*H/N - 1 (and the same slice of the MLP's intermediate). Row-parallel projections (o,
down) split their input the same way and produce a partial sum of the whole output, which one all-reduce
completes; their bias lives on rank 0 only. Embeddings, norms and lm_head are replicated.

LoRA, after S-LoRA: on a column-parallel projection A is replicated (each rank shrinks to the full rank r) and
B is split by output rows; on a row-parallel projection A is split by input columns (each rank's shrink is a
partial [T, r]) and B is replicated, so each rank's expand is a partial delta that rides the base projection's
own all-reduce: no collective of its own.
"""

import dataclasses

import torch

import adapters
from adapters.base_shapes import PROJECTIONS

ROW_PARALLEL = ("o_proj", "down_proj", "experts_down_proj", "shared_expert_down_proj")
COLUMN_PARALLEL = tuple(m for m in PROJECTIONS if m not in ROW_PARALLEL) + ("shared_expert_gate_proj",
                                                                             "shared_expert_up_proj")
# the experts' LoRA (adapters.base_shapes.EXPERT_MODULES): down as down_proj; gate_up's B by the rows of each
# half (this rank's gate rows, then its up rows), as Experts holds its slice of gate and of up


def check_divisible(*, num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> None:
    """ValueError naming the counts when the model cannot be split over `size` ranks."""
    counts = {"attention heads": num_heads, "key/value heads": num_kv_heads, "intermediate size": intermediate_size}
    bad = [name for name, count in counts.items() if count % size]
    if bad:
        raise ValueError(f"tensor_parallel_size {size} must divide this model's attention heads ({num_heads}), "
                         f"key/value heads ({num_kv_heads}) and intermediate size ({intermediate_size}); "
                         f"it does not divide the {' nor the '.join(bad)}")


def check_tensor_parallel(args, *, size: int, device: torch.device) -> None:
    """ValueError when the model (engine.models.ModelSpec) cannot be split over `size` ranks on `device`."""
    if size == 1:
        return
    check_divisible(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                    intermediate_size=args.intermediate_size, size=size)
    moe = getattr(args, "moe", None)  # every rank holds its slice of each expert's intermediate
    for what, width in (("expert", moe.intermediate_size), ("shared expert", moe.shared_intermediate_size)) if moe \
            else ():
        if width % size:
            raise ValueError(f"tensor_parallel_size {size} must divide this model's {what} intermediate size "
                             f"({width})")
    if device.type == "cuda":
        first, count = device.index or 0, torch.cuda.device_count()
        if first + size > count:
            raise ValueError(f"tensor_parallel_size {size} from {device} needs devices cuda:{first}.."
                             f"cuda:{first + size - 1}; this machine has {count} CUDA device(s)")


def checkpoint_slice(name: str, shape: tuple[int, ...], *, rank: int, size: int) -> tuple[slice, ...] | None:
    """The part of checkpoint tensor `name` rank `rank` holds, as an index; None: all of it, or (for a
    row-parallel bias on ranks other than 0) nothing, which `holds_none` tells apart."""
    if size == 1:
        return None
    module_name, _, kind = name.rpartition(".")
    proj = module_name.rpartition(".")[2]
    if kind == "weight_scale_inv":  # fp8 block scales: read whole, the module takes its rows' (a shard may cut a block)
        return None
    if kind in ("weight_scale", "input_scale") and len(shape) <= 1:  # compressed-tensors experts' per-tensor scales
        return None
    if proj in COLUMN_PARALLEL:
        part = shape[0] // size
        return (slice(rank * part, (rank + 1) * part),)
    if proj in ROW_PARALLEL and kind == "weight":
        part = shape[1] // size
        return (slice(None), slice(rank * part, (rank + 1) * part))
    return None


def holds_none(name: str, *, rank: int, size: int) -> bool:
    """A row-parallel bias is added once, by rank 0; the other ranks hold zeros."""
    module_name, _, kind = name.rpartition(".")
    return size > 1 and rank > 0 and kind == "bias" and module_name.rpartition(".")[2] in ROW_PARALLEL


def shard_adapter(adapter: "adapters.LoadedAdapter", *, rank: int, size: int) -> "adapters.LoadedAdapter":
    """The rank's part of an adapter: B split by output rows on column-parallel modules, A split by input
    columns on row-parallel ones (ranks and scalings unchanged); the experts' gate_up B by each half's rows."""
    if size == 1:
        return adapter
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in adapter.tensors.items():
        key, _, half = name.rpartition(".")
        module = key.rpartition(".")[2]
        if module in ROW_PARALLEL and half == "lora_A":  # [r, in]
            part = tensor.shape[1] // size
            tensor = tensor[:, rank * part : (rank + 1) * part]
        elif module in COLUMN_PARALLEL and half == "lora_B":  # [out, r]
            part = tensor.shape[0] // size
            tensor = tensor[rank * part : (rank + 1) * part]
        elif module == "experts_gate_up_proj" and half == "lora_B":  # [2I, E*r]: gate rows, then up rows
            part = tensor.shape[0] // (2 * size)
            gate, up = tensor.chunk(2)
            tensor = torch.cat([gate[rank * part : (rank + 1) * part], up[rank * part : (rank + 1) * part]])
        tensors[name] = tensor.contiguous()
    return dataclasses.replace(adapter, tensors=tensors)
