"""Qwen2.5-VL's vision encoder, mirroring transformers' Qwen2_5_VisionTransformerPretrainedModel: patches
embedded by one matmul (the checkpoint's Conv3d, whose stride is its kernel), blocks of RMSNorm, attention with a
2-D rope (row and column of each patch) and a gated MLP, attention within windows of window_size pixels except
in the fullatt_block_indexes blocks, then the merger: RMSNorm, each 2 x 2 patches concatenated, an MLP to the
language model's width.

Every image of a step goes through one call: the images' patches are concatenated and each attends only to its
own image (or window), by a block-diagonal mask."""

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.models.layers import RMSNorm


class PatchEmbed(nn.Module):
    def __init__(self, config: dict, *, bias: bool = False) -> None:
        super().__init__()
        self.patch_dim = config.get("in_channels", 3) * config["temporal_patch_size"] * config["patch_size"] ** 2
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(config["hidden_size"], config.get("in_channels", 3),
                                                    config["temporal_patch_size"], config["patch_size"],
                                                    config["patch_size"]), requires_grad=False)
        self.proj.bias = nn.Parameter(torch.empty(config["hidden_size"]), requires_grad=False) if bias else None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.reshape(weight.shape[0], self.patch_dim),
                        self.proj.bias)  # [P, hidden]


class VisionAttention(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        dim = config["hidden_size"]
        self.num_heads = config["num_heads"]
        self.head_dim = dim // self.num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        num = x.shape[0]
        q, k, v = self.qkv(x).reshape(num, 3, self.num_heads, self.head_dim).unbind(1)  # [P, heads, D] each
        q, k = q.contiguous(), k.contiguous()
        kernels.rotary_embedding(torch.arange(num, device=x.device), q, k, rope)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=mask)  # [heads, P, D]
        return self.proj(out.transpose(0, 1).reshape(num, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        dim, inter = config["hidden_size"], config["intermediate_size"]
        self.gate_proj, self.up_proj = nn.Linear(dim, inter), nn.Linear(dim, inter)
        self.down_proj = nn.Linear(inter, dim)
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported vision activation {config.get('hidden_act')!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(x)); the family gives its norm (made with the width) and MLP."""

    def __init__(self, config: dict, *, norm=lambda size: RMSNorm(size, 1e-6), mlp=None) -> None:
        super().__init__()
        self.norm1, self.norm2 = norm(config["hidden_size"]), norm(config["hidden_size"])
        self.attn = VisionAttention(config)
        self.mlp = (mlp or VisionMLP)(config)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.merged = config["hidden_size"] * config["spatial_merge_size"] ** 2
        self.ln_q = RMSNorm(config["hidden_size"], 1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged), nn.GELU(),
                                 nn.Linear(self.merged, config["out_hidden_size"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.merged))


class QwenVisionTower(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.merge = config["spatial_merge_size"]
        self.window = config["window_size"] // config["spatial_merge_size"] // config["patch_size"]  # in merged cells
        self.full_blocks = set(config.get("fullatt_block_indexes", ()))
        self.head_dim = config["hidden_size"] // config["num_heads"]
        self.theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config["depth"]))
        self.merger = PatchMerger(config)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixels [P, patch_dim] of every image, grids their (t, h, w) patches; returns the merged tokens
        [P / merge^2, out_hidden], image after image, each in its merge cells' raster order (its placeholder
        tokens' order), and no deepstack features."""
        order, windows = self._windows(grids)
        device = pixels.device
        merge_unit = self.merge**2
        x = self.patch_embed(pixels)  # [P, hidden]
        num, dim = x.shape
        order_t = torch.tensor(order, device=device)
        x = x.reshape(-1, merge_unit, dim)[order_t].reshape(num, dim)  # merge cells grouped window by window
        rope = patch_rope(patch_positions(grids, self.merge), self.head_dim, self.theta)  # [P, D]
        rope = rope.reshape(-1, merge_unit, rope.shape[-1])[order].reshape(num, -1).to(device)
        images = [t * h * w for t, h, w in grids]
        full_mask, window_mask = block_mask(images, device), block_mask(windows, device)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, full_mask if i in self.full_blocks else window_mask)
        merged = self.merger(x)  # [P / merge^2, out]
        return merged[torch.argsort(order_t)], []

    def _windows(self, grids):
        """(merge-cell order that groups each window's cells, window lengths in patches) over all images: windows
        of self.window x self.window merged cells, clipped at the edges."""
        order, windows, base = [], [], 0
        m, size = self.merge, self.window
        for t, h, w in grids:
            gh, gw = h // m, w // m
            for _ in range(t):
                for wy in range(0, gh, size):
                    for wx in range(0, gw, size):
                        cells = [base + y * gw + x for y in range(wy, min(wy + size, gh))
                                 for x in range(wx, min(wx + size, gw))]
                        order += cells
                        windows.append(len(cells) * m * m)
                base += gh * gw
        return order, windows


def patch_positions(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[P, 2] (row, column) of every patch of the images, in the processor's order: merge cell by merge cell,
    each cell's merge x merge patches row-major, every frame alike."""
    positions = []
    for t, h, w in grids:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        cells = (h // merge, merge, w // merge, merge)
        frame = torch.stack([rows.reshape(cells).transpose(1, 2).flatten(),
                             cols.reshape(cells).transpose(1, 2).flatten()], dim=-1)  # [h * w, 2]
        positions.append(frame.repeat(t, 1))
    return torch.cat(positions)


def patch_rope(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """[P, head_dim] rope rows of the vision encoder's 2-D rope, as kernels.rotary_embedding reads them (cos
    halves, then sin halves): a head's first quarter of frequencies turns with the patch's row, the second
    with its column."""
    quarter = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter)  # [D / 4]
    freqs = (positions.float()[..., None] * inv_freq).reshape(positions.shape[0], -1)  # [P, D / 2]: rows, columns
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def block_mask(lengths: list[int], device: torch.device) -> torch.Tensor:
    """[P, P] bool: True where query and key lie in the same run of `lengths`."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
    return ids[:, None] == ids[None, :]
