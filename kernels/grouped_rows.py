"""The references' grouped product: rows sorted by group, each group's rows times its own matrix.

torch._grouped_mm does it in one call on CPU for float32 rows whose widths are multiples of 4 (it needs 16-byte
strides), exactly as a matmul per group; other shapes take one matmul per group that has rows. It is the CPU
path of grouped_matmul (the experts) and expert_lora (each row's adapter of its expert)."""

import torch

_GROUPED_MM_WORKS: dict[str, bool] = {}  # device type -> whether torch._grouped_mm serves float32 rows there


def _grouped_mm_works(device: torch.device) -> bool:
    """Only on CPU (CUDA's grouped product wants bf16 on sm90; these are the float32 references), and only while this
    torch has it: it is private API (torch 2.13 on CPU has it; the GPU machine's torch 2.11 may not)."""
    if device.type != "cpu" or not hasattr(torch, "_grouped_mm"):
        return False
    return _GROUPED_MM_WORKS.setdefault(device.type, True)


def grouped_rows(x: torch.Tensor, weight_t: torch.Tensor, bounds: list[int] | torch.Tensor) -> torch.Tensor:
    """out[r] = x[r] @ weight_t[g] for bounds[g] <= r < bounds[g + 1], in float32.

    x [N, in] with N = bounds[-1]; weight_t [G, in, out] (any strides); bounds [G + 1] non-decreasing from 0 (a
    list, or an int tensor on x's device). Returns out [N, out] float32."""
    rows, in_dim = x.shape
    groups, _, out_dim = weight_t.shape
    xs = x if x.dtype == torch.float32 else x.float()
    w = weight_t if weight_t.dtype == torch.float32 else weight_t.float()
    if (_grouped_mm_works(xs.device) and rows and in_dim % 4 == 0 and out_dim % 4 == 0
            and all(s % 4 == 0 for s in w.stride() if s != 1)):
        ends = bounds[1:] if isinstance(bounds, torch.Tensor) else torch.tensor(bounds[1:])
        try:
            return torch._grouped_mm(xs.contiguous(), w, offs=ends.to(torch.int32).contiguous())
        except (RuntimeError, NotImplementedError):  # a torch without the CPU float32 kernel: the loop from now on
            _GROUPED_MM_WORKS[xs.device.type] = False
    out = xs.new_empty(rows, out_dim)  # [N, out]
    starts = bounds.tolist() if isinstance(bounds, torch.Tensor) else bounds
    for group in range(groups):
        start, end = starts[group], starts[group + 1]
        if end > start:
            out[start:end] = xs[start:end] @ w[group]
    return out
