"""Qwen3-VL's vision encoder, mirroring transformers' Qwen3VLVisionModel: patches embedded by one matmul with a
bias, a learned square grid of position embeddings resampled bilinearly (corners aligned) to each image's patch
grid, LayerNorm blocks with whole-image attention under the 2-D rope and a GELU MLP, then the merger; the
deepstack mergers take the output of some blocks too, which the language model adds to the image tokens' hidden
states after its first layers."""

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.qwen_vision import PatchEmbed, VisionBlock, block_mask, patch_positions, patch_rope


class VisionMLP(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config["hidden_size"], config["intermediate_size"])
        self.linear_fc2 = nn.Linear(config["intermediate_size"], config["hidden_size"])
        if config.get("hidden_act", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported vision activation {config.get('hidden_act')!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class PatchMerger(nn.Module):
    """Each merge x merge patches concatenated, then LayerNorm (before the concatenation for the final merger,
    after it for the deepstack ones) and a GELU MLP."""

    def __init__(self, config: dict, *, norm_after_merge: bool) -> None:
        super().__init__()
        self.merged = config["hidden_size"] * config["spatial_merge_size"] ** 2
        self.norm_after_merge = norm_after_merge
        self.norm = nn.LayerNorm(self.merged if norm_after_merge else config["hidden_size"], eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, config["out_hidden_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.merged)) if self.norm_after_merge else self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTower(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.merge = config["spatial_merge_size"]
        self.head_dim = config["hidden_size"] // config["num_heads"]
        self.theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.side = int(config["num_position_embeddings"] ** 0.5)
        self.deepstack_layers = list(config.get("deepstack_visual_indexes", ()))
        self.patch_embed = PatchEmbed(config, bias=True)
        self.pos_embed = nn.Embedding(config["num_position_embeddings"], config["hidden_size"])
        self.blocks = nn.ModuleList(VisionBlock(config, norm=lambda size: nn.LayerNorm(size, eps=1e-6), mlp=VisionMLP)
                                    for _ in range(config["depth"]))
        self.merger = PatchMerger(config, norm_after_merge=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(config, norm_after_merge=True)
                                                   for _ in self.deepstack_layers)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]):
        """pixels [P, patch_dim], grids each image's (t, h, w) patches; returns the merged tokens
        [P / merge^2, out_hidden] and the deepstack ones, one such tensor per deepstack layer."""
        device = pixels.device
        positions = patch_positions(grids, self.merge)  # [P, 2]
        x = self.patch_embed(pixels) + self._grid_embeddings(positions, grids).to(device, pixels.dtype)
        rope = patch_rope(positions, self.head_dim, self.theta).to(device)
        mask = block_mask([t * h * w for t, h, w in grids], device)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, mask)
            if i in self.deepstack_layers:
                deepstack.append(self.deepstack_merger_list[self.deepstack_layers.index(i)](x))
        return self.merger(x), deepstack

    def _grid_embeddings(self, positions: torch.Tensor, grids) -> torch.Tensor:
        """[P, hidden] the learned side x side grid resampled bilinearly, corners aligned, to each patch's place
        in its image's h x w grid."""
        sizes = torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grids])  # [P, 2]
        taps, weights = [], []
        for axis in range(2):
            source = positions[:, axis].float() * (self.side - 1) / (sizes[:, axis] - 1).clamp(min=1)
            low = source.floor()
            axis_taps = (low.long()[:, None] + torch.arange(2)).clamp(0, self.side - 1)  # [P, 2]
            taps.append(axis_taps)
            weights.append((1 - (source[:, None] - low[:, None] - torch.arange(2)).abs()).clamp(min=0))
        index = (taps[0][:, :, None] * self.side + taps[1][:, None, :]).reshape(-1, 4).to(self.pos_embed.weight.device)
        weight = (weights[0][:, :, None] * weights[1][:, None, :]).reshape(-1, 4)
        return (self.pos_embed(index) * weight[:, :, None].to(self.pos_embed.weight)).sum(1)
