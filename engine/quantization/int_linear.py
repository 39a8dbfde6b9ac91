"""The integer-weight projection (W4A16, W8A16) every integer checkpoint format is served as.

GPTQ, AWQ and compressed-tensors' pack-quantized and naive-quantized store the same thing in different orders:
integer weights, a float scale per (group of input channels, output), an integer zero point per the same, and
for act order each input channel's group (g_idx). `IntLinear.finish()` asks its format for that content in one
layout, GPTQ's (kernels/wna16_reference.py): repacked, never dequantized. The forward is
`kernels.wna16_linear`: the Triton GEMM that dequantizes tiles in registers on CUDA (decode and prefill), its
reference on CPU."""

import torch

import kernels
from engine.context import Context
from engine.quantization.packed_linear import PackedLinear
from engine.quantization.spec import QuantSpec
from kernels.wna16_reference import WNA16_BITS, pack_cols, pack_rows, unpack_rows

GROUP_SIZES = (32, 64, 128, -1)  # -1: one scale per output channel


def check_int_spec(spec: QuantSpec, *, bits: tuple[int, ...] = WNA16_BITS) -> None:
    if spec.bits not in bits:
        raise ValueError(f"{spec.scheme}: {spec.bits}-bit weights are not served; the kernels take "
                         f"{' or '.join(map(str, bits))} bits")
    if spec.group_size not in GROUP_SIZES:
        raise ValueError(f"{spec.scheme}: group size {spec.group_size} is not served; the kernels take "
                         f"32, 64, 128 or -1 (per output channel)")


class IntLinear(PackedLinear):
    """Subclasses give `canonical()`; buffers after finish(): qweight [in / p, out] int32, scales [G, out] (the
    checkpoint's float dtype), zeros [G, out / p] int32, g_idx [in] int32 (kernels.reference.wna16_linear)."""

    bits: int
    scale_kind = "scales"  # the stored kind of the scales

    @property
    def pack(self) -> int:
        return 32 // self.spec.bits

    def num_groups(self) -> int:
        """Rows of scales this rank holds: per channel 1; act order every group of the whole input (g_idx on a
        row-parallel shard points anywhere); else this rank's groups."""
        if self.spec.group_size == -1:
            return 1
        if self.spec.desc_act:
            return self.in_total // self.spec.group_size
        return self.in_features // self.spec.group_size

    def check_shard(self) -> None:
        """ValueError when this rank's part cannot be packed or grouped (a row-parallel split inside a group)."""
        per, group = self.pack, self.spec.group_size
        if self.in_features % per or any(width % per for width in self.out_slices):
            raise ValueError(f"{self.name}: {self.in_features} inputs, outputs {self.out_slices} on this rank: "
                             f"{self.spec.describe()} needs multiples of {per}")
        if group != -1 and not self.spec.desc_act and self.in_features % group:
            raise ValueError(f"{self.name}: {self.in_features} inputs on this rank is not a whole number of groups "
                             f"of {group} (tensor_parallel_size splits a group)")

    def canonical(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(qweight [in / p, out] int32, scales [G, out], zeros [G, out] int32 unpacked, g_idx [in] or None)."""
        raise NotImplementedError

    def finish(self) -> None:
        """The kernel's tensors are made first, then the conversion's results copied in. Made after it, on CUDA
        they would be cut from the large blocks its scratch (the unpacked, int64 words) left in torch's cache,
        and each would keep such a segment from going back to the device when the loader empties the cache
        before the page pool is sized from free memory (engine/models/loader.py)."""
        device, groups, bits = getattr(self, self.scale_kind).device, self.num_groups(), self.spec.bits
        made = {"qweight": (self.in_features // self.pack, self.out_features),
                "zeros": (groups, self.out_features // self.pack), "g_idx": (self.in_features,),
                "perm": (self.in_features,) if self.spec.desc_act else None}  # perm: act order sorted
        kept = {kind: torch.empty(shape, dtype=torch.int32, device=device)
                for kind, shape in made.items() if shape is not None}
        kept["scales"] = torch.empty(groups, self.out_features, dtype=self.stored_dtypes[self.scale_kind],
                                     device=device)
        qweight, scales, zeros, g_idx = self.canonical()
        for kind in list(self._parameters):
            if kind != "bias":
                delattr(self, kind)
        self.group_size = 0  # act order on a row-parallel shard: the kernel reads each channel's group from g_idx
        self.register_buffer("perm", None)  # act order sorted at load: x's column order, [in] int32
        if g_idx is not None:
            self._check_g_idx(g_idx)
            if self.spec.group_size == -1 or not (self.row_parallel and self.tp_size > 1):
                # act order over the whole input: sort the channels by group (the weight's rows here, x's columns
                # in the kernel), so the groups are in order as without act order (vLLM does the same)
                perm = torch.argsort(g_idx.long(), stable=True)
                qweight = pack_rows(unpack_rows(qweight, bits)[perm], bits)
                self.perm = kept["perm"].copy_(perm)  # [in]
                g_idx = None
        if g_idx is None:  # groups in order: the kernel reads one row of scales per tile
            self.group_size = self.in_features if self.spec.group_size == -1 else self.spec.group_size
            g_idx = torch.arange(self.in_features, device=device) // self.group_size
        self.register_buffer("qweight", kept["qweight"].copy_(qweight))  # [in / p, out] int32
        self.register_buffer("scales", kept["scales"].copy_(scales))  # [G, out]
        self.register_buffer("zeros", kept["zeros"].copy_(pack_cols(zeros, bits)))  # [G, out / p] int32
        self.register_buffer("g_idx", kept["g_idx"].copy_(g_idx))  # [in]

    def _check_g_idx(self, g_idx: torch.Tensor) -> None:
        """g_idx must deal the input channels into groups of group_size: each in range, and (on a whole
        projection) each group exactly group_size times, i.e. sorting by it is a permutation into groups."""
        groups = self.num_groups()
        size = self.in_total if self.spec.group_size == -1 else self.spec.group_size
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise ValueError(f"{self.name}: g_idx holds groups outside 0..{groups - 1}")
        if self.row_parallel and self.tp_size > 1:
            return  # a shard's channels are any of the groups' members
        counts = torch.bincount(g_idx.long(), minlength=groups)
        if not bool((counts == size).all()):
            raise ValueError(f"{self.name}: g_idx is not a permutation of the input channels into groups of "
                             f"{size} (group sizes {sorted(set(counts.tolist()))})")

    def forward(self, x: torch.Tensor, ctx: Context | None = None) -> torch.Tensor:
        y = kernels.wna16_linear(x, self.qweight, self.scales, self.zeros, self.g_idx, self.spec.bits,
                                 group_size=self.group_size, perm=self.perm)  # [T, out]
        return y if self.bias is None else y + self.bias
