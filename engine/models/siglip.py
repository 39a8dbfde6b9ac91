"""SigLIP's vision encoder, mirroring transformers' SiglipVisionModel without its pooling head (Gemma 3 reads
the last hidden state): patches embedded by a convolution whose stride is its kernel, a learned position
embedding per patch, pre-LayerNorm blocks of whole-image attention (q, k, v and out projections with biases)
and a tanh-approximated GELU MLP, then a final LayerNorm.

Every image has the processor's one size, so the images of a step are one batch [N, 3, H, W] and attend
within themselves without a mask."""

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


class VisionEmbeddings(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        patch, hidden = config["patch_size"], config["hidden_size"]
        self.patch_embedding = nn.Conv2d(config.get("num_channels", 3), hidden, kernel_size=patch, stride=patch)
        self.position_embedding = nn.Embedding((config["image_size"] // patch) ** 2, hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.weight
        x = self.patch_embedding(pixels.to(weight.dtype)).flatten(2).transpose(1, 2)  # [N, patches, hidden]
        if x.shape[1] != self.position_embedding.num_embeddings:
            raise ValueError(f"an image of {x.shape[1]} patches; this encoder takes "
                             f"{self.position_embedding.num_embeddings}")
        return x + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        dim = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        heads = [proj(x).view(batch, length, self.num_heads, -1).transpose(1, 2)
                 for proj in (self.q_proj, self.k_proj, self.v_proj)]  # [N, heads, patches, D] each
        out = F.scaled_dot_product_attention(*heads)  # [N, heads, patches, D]
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, dim))


class VisionMLP(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config["hidden_size"], config["intermediate_size"])
        self.fc2 = nn.Linear(config["intermediate_size"], config["hidden_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class EncoderLayer(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        eps = config.get("layer_norm_eps", 1e-6)
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(config["hidden_size"], eps), nn.LayerNorm(config["hidden_size"], eps)
        self.self_attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipVisionTower(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        if config.get("hidden_act", "gelu_pytorch_tanh") not in ACTIVATIONS:
            raise ValueError(f"unsupported vision activation {config.get('hidden_act')!r}")
        self.embeddings = VisionEmbeddings(config)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config["num_hidden_layers"]))
        self.post_layernorm = nn.LayerNorm(config["hidden_size"], config.get("layer_norm_eps", 1e-6))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, H, W] -> [N, patches, hidden], patches in raster order."""
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
