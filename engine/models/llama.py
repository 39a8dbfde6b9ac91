"""Llama 2/3 and Mistral, mirroring transformers' modeling_llama with q/k/v and gate/up
fused; the residual add is fused into each norm."""

import torch
from torch import nn

from engine.context import Context
from engine.models.causal_lm import CausalLM
from engine.models.layers import Attention, GatedMLP, RMSNorm
from engine.models.spec import ModelSpec, every_layer_windowed
from engine.parallel.communicator import Communicator


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, comm: Communicator, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(spec, comm, layer)
        self.mlp = GatedMLP(spec, comm)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, ctx: Context):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, ctx), residual


class LlamaForCausalLM(CausalLM):
    """Llama and Mistral (whose window, when set, is on every layer)."""

    decoder_layer = LlamaDecoderLayer

    @classmethod
    def read_spec(cls, config: dict) -> ModelSpec:
        return ModelSpec.from_hf_config(config, default_layer_types=every_layer_windowed)

