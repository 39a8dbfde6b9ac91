"""A linear layer whose output may be several projections concatenated (fused q/k/v, gate/up)."""

import torch
import torch.nn.functional as F
from torch import nn

from engine.context import Context


class Linear(nn.Module):
    def __init__(self, in_features: int, out_slices: list[int], *, bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_slices = list(out_slices)
        self.slice_offsets = tuple(sum(out_slices[:i]) for i in range(len(out_slices) + 1))
        out_features = self.slice_offsets[-1]
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)  # [out, in]
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None  # [out]

    def load_slice(self, index: int, kind: str, tensor: torch.Tensor) -> None:
        """Copy one projection's "weight" or "bias" into its rows of the fused output."""
        o0, o1 = self.slice_offsets[index], self.slice_offsets[index + 1]
        getattr(self, kind).data[o0:o1].copy_(tensor)

    def forward(self, x: torch.Tensor, ctx: Context | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
