"""Qwen2 and Qwen3: the Llama layer, with biased q/k/v (Qwen2) or per-head q/k RMSNorm before rope and an
explicit head_dim (Qwen3); the sliding window, when used, on the layers from max_window_layers on."""

from engine.models.llama import LlamaForCausalLM
from engine.models.spec import FULL, SLIDING, ModelSpec


def qwen_layer_types(config: dict) -> list[str]:
    """The layer types of a config from before `layer_types`."""
    layers = config["num_hidden_layers"]
    first = config.get("max_window_layers", 0) if config.get("use_sliding_window") else layers
    return [SLIDING if i >= first else FULL for i in range(layers)]


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def read_spec(cls, config: dict) -> ModelSpec:
        return ModelSpec.from_hf_config(config, default_layer_types=qwen_layer_types, qkv_bias=True, o_bias=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def read_spec(cls, config: dict) -> ModelSpec:
        return ModelSpec.from_hf_config(config, default_layer_types=qwen_layer_types, qk_norm=True)
