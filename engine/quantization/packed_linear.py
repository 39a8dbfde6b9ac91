"""A decoder projection read from a pre-quantized checkpoint, held as the checkpoint stores it.

Each format (engine/quantization/<family>.py) subclasses PackedLinear: it names the tensors a projection is
stored as (`stored`: kind -> shape, and `layouts`: which of each tensor's dims runs over the output features
and which over the input features), and `finish()` turns the loaded tensors into its kernel's layout without
dequantizing them. A fused projection (q/k/v, gate/up) holds its slices' tensors concatenated along their
output dim, as `Linear` concatenates its weight rows; it keeps `in_features`, `out_slices` and
`slice_offsets`, so `LoRALinear` wraps it as it wraps a `Linear`. Under tensor parallelism the loader reads
each rank's part of every stored tensor (`shard_index`): column-parallel projections split the output dim,
row-parallel ones the input dim, and a tensor whose input dim is not split (act-order scales, per-channel
scales, which every rank needs whole) is read whole."""

from dataclasses import dataclass

import torch
from torch import nn

from engine.quantization.spec import QuantSpec


@dataclass(frozen=True)
class TensorLayout:
    out_dim: int | None  # the dim over output features (None: shared by every output, e.g. g_idx)
    in_dim: int | None  # the dim over input features (None: not split by a row-parallel shard)


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class PackedLinear(nn.Module):
    loads_as_stored = True  # CausalLM.load_weights hands it every stored tensor (load_slice), o_proj's and down_proj's too
    marker = ""  # the stored kind that tells a projection of this format in the checkpoint ("qweight", ...)

    @classmethod
    def check_spec(cls, spec: QuantSpec) -> None:
        """ValueError naming what the kernels lack (bits, group size, ...)."""

    @classmethod
    def layouts(cls, spec: QuantSpec) -> dict[str, TensorLayout]:
        raise NotImplementedError

    def stored(self) -> dict[str, tuple[int, ...]]:
        """kind -> the shape this rank's whole (fused) projection stores it as."""
        raise NotImplementedError

    def __init__(self, base: nn.Module, spec: QuantSpec, *, name: str, dtypes: dict[str, torch.dtype],
                 tp_size: int = 1, tp_rank: int = 0, row_parallel: bool = False) -> None:
        """base: the model's Linear it replaces (on meta: in_features, out_slices, slice_offsets, weight, bias);
        dtypes: each kind's dtype as the checkpoint stores it."""
        super().__init__()
        self.spec, self.name = spec, name
        self.in_features = base.in_features
        self.out_slices = list(base.out_slices)
        self.slice_offsets = base.slice_offsets
        self.out_features = self.slice_offsets[-1]
        self.tp_size, self.tp_rank, self.row_parallel = tp_size, tp_rank, row_parallel
        self.in_total = base.in_features * tp_size if row_parallel else base.in_features  # before sharding
        self.bias = base.bias  # [out] in the model dtype, or None
        self.dtype = base.weight.dtype  # the activation (model) dtype
        self._shared: dict[str, torch.Tensor] = {}  # the first slice's tensor of a kind shared by every slice
        self.stored_fused: set[str] = set()  # checkpoint names of tensors holding every slice (load_fused)
        self.stored_dtypes = dtypes
        for kind, shape in self.stored().items():
            if kind not in dtypes:
                raise ValueError(f"{name}: the checkpoint has no {kind} ({spec.describe()} stores "
                                 f"{', '.join(self.stored())})")
            self.register_parameter(kind, nn.Parameter(torch.empty(shape, dtype=dtypes[kind]), requires_grad=False))

    def slice_count(self, kind: str) -> int:
        """How many checkpoint tensors fill `kind` (CausalLM.load_weights checks they all came)."""
        return len(self.out_slices)

    def load_slice(self, index: int, kind: str, tensor: torch.Tensor) -> None:
        """Copy slice `index`'s stored `kind` into its part of the fused projection, after checking its shape."""
        o0, o1 = self.slice_offsets[index], self.slice_offsets[index + 1]
        if kind == "bias":
            self.bias.data[o0:o1].copy_(tensor)
            return
        layouts = self.layouts(self.spec)
        if kind not in layouts:
            raise ValueError(f"{self.name}: unexpected tensor {kind!r} for {self.spec.describe()}")
        target, out_dim = getattr(self, kind).data, layouts[kind].out_dim
        if out_dim is not None:
            per = self.out_features // target.shape[out_dim] if target.shape[out_dim] else 1  # outputs per element
            if (o1 - o0) % per:
                raise ValueError(f"{self.name}: slice {index} has {o1 - o0} outputs, not a multiple of the {per} "
                                 f"that {kind} packs in one element")
            target = target.narrow(out_dim, o0 // per, (o1 - o0) // per)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"{self.name}: {kind} of slice {index} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(target.shape)} for {self.spec.describe()}")
        if out_dim is None:  # one tensor for every slice (g_idx): the slices must agree
            first = self._shared.setdefault(kind, tensor.clone())
            if not torch.equal(first, tensor):
                raise ValueError(f"{self.name}: the fused slices have different {kind}; a fused projection needs one")
        target.copy_(tensor)

    def load_fused(self, kind: str, tensor: torch.Tensor) -> None:
        """A fused projection's `kind` as a checkpoint that fuses it stores it (Phi-3's qkv_proj.qweight: every
        slice's outputs in one tensor, in slice order along its output dim), read whole by every rank: each
        slice's part of it, then this rank's share of that part (a fused projection is column-parallel)."""
        layout = self.layouts(self.spec).get(kind, TensorLayout(out_dim=0, in_dim=None))  # bias: as a weight's
        if layout.out_dim is None:  # one tensor for every slice (g_idx)
            parts = [tensor] * len(self.out_slices)
        else:
            dim, held = layout.out_dim, getattr(self, kind).shape[layout.out_dim]  # this rank's share of it
            per = self.out_features // held if held else 1  # outputs per element
            if any(width % per for width in self.out_slices):
                raise ValueError(f"{self.name}: slices of {self.out_slices} outputs on this rank, not multiples of "
                                 f"the {per} that {kind} packs in one element")
            widths = [width * self.tp_size // per for width in self.out_slices]  # each slice's, as written
            if tensor.dim() <= dim or tensor.shape[dim] != sum(widths):
                raise ValueError(f"{self.name}: fused {kind} has shape {tuple(tensor.shape)}; {self.spec.describe()} "
                                 f"with outputs {[w * self.tp_size for w in self.out_slices]} needs {sum(widths)} "
                                 f"along dim {dim}")
            parts = tensor.split(widths, dim=dim)
        for index, part in enumerate(parts):
            share = shard_index(layout, tuple(part.shape), rank=self.tp_rank, size=self.tp_size, column=True)
            self.load_slice(index, kind, part if share is None else part[share])

    def finish(self) -> None:
        """Every stored tensor is loaded: check them and put them in the kernel's layout."""
        raise NotImplementedError

    def full_precision_bytes(self) -> int:
        """The bytes this projection would take unquantized, in the model dtype."""
        bias = self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        return self.in_features * self.out_features * self.dtype.itemsize + bias


def shard_index(layout: TensorLayout, shape: tuple[int, ...], *, rank: int, size: int,
                column: bool) -> tuple[slice, ...] | None:
    """Rank `rank`'s part of a stored tensor of `shape`: its share of the output dim (column-parallel) or of the
    input dim (row-parallel); None: all of it."""
    dim = layout.out_dim if column else layout.in_dim
    if size == 1 or dim is None:
        return None
    if shape[dim] % size:
        raise ValueError(f"a stored tensor of shape {shape} cannot be split over {size} ranks along dim {dim}")
    part = shape[dim] // size
    return (slice(None),) * dim + (slice(rank * part, (rank + 1) * part),)
