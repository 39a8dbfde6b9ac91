"""Gemma 2 and Gemma 3 (text), mirroring transformers' modeling_gemma2/3: four (1 + w) RMSNorms per layer
around attention and the GeGLU MLP, embeddings scaled by sqrt(hidden), query_pre_attn_scalar, soft-capped
attention and output logits (Gemma 2), per-head q/k norms and a local rope base for the sliding layers
(Gemma 3); sliding and full attention alternate by layer."""

import torch
from torch import nn

from engine.context import Context
from engine.models.causal_lm import CausalLM
from engine.models.layers import Attention, GatedMLP, RMSNorm
from engine.models.spec import FULL, SLIDING, ModelSpec, embedding_scale
from engine.parallel.communicator import Communicator


class GemmaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, comm: Communicator, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(spec, comm, layer)
        self.mlp = GatedMLP(spec, comm)
        size, eps, offset = spec.hidden_size, spec.rms_norm_eps, spec.norm_offset
        self.input_layernorm = RMSNorm(size, eps, offset=offset)
        self.post_attention_layernorm = RMSNorm(size, eps, offset=offset)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, offset=offset)
        self.post_feedforward_layernorm = RMSNorm(size, eps, offset=offset)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: None, ctx: Context):
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), ctx))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), ctx))
        return x, None


def gemma2_layer_types(config: dict) -> list[str]:
    """Gemma 2 before `layer_types`: sliding, full, sliding, ..."""
    return [SLIDING if i % 2 == 0 else FULL for i in range(config["num_hidden_layers"])]


def gemma3_layer_types(config: dict) -> list[str]:
    """Gemma 3 before `layer_types`: every sliding_window_pattern-th layer full, the others sliding (5 : 1)."""
    pattern = config.get("sliding_window_pattern", 6)
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(config["num_hidden_layers"])]


class Gemma2ForCausalLM(CausalLM):
    decoder_layer = GemmaDecoderLayer

    @classmethod
    def read_spec(cls, config: dict) -> ModelSpec:
        return ModelSpec.from_hf_config(config, default_layer_types=gemma2_layer_types, norm_offset=1.0,
                                        embed_scale=embedding_scale(config))


class Gemma3ForCausalLM(CausalLM):
    decoder_layer = GemmaDecoderLayer

    @classmethod
    def read_spec(cls, config: dict) -> ModelSpec:
        return ModelSpec.from_hf_config(config, default_layer_types=gemma3_layer_types, norm_offset=1.0,
                                        embed_scale=embedding_scale(config), qk_norm=True)
