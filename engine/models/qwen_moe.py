"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 layer with experts (softmax, top k, renormalised when
norm_topk_prob) on the layers decoder_sparse_step and mlp_only_layers leave sparse, the dense GatedMLP on the
others; Qwen2-MoE adds its gated shared expert."""

from engine.models.moe import MoECausalLM, num_experts, sparse_layers
from engine.models.qwen import qwen_layer_types
from engine.models.spec import ModelSpec, MoESpec


def _moe(config: dict, *, shared: bool) -> MoESpec:
    return MoESpec(num_experts=num_experts(config), top_k=config["num_experts_per_tok"],
                   intermediate_size=config["moe_intermediate_size"],
                   renormalize=bool(config.get("norm_topk_prob", False)), sparse_layers=sparse_layers(config),
                   shared_intermediate_size=config.get("shared_expert_intermediate_size", 0) if shared else 0)


class Qwen3MoeForCausalLM(MoECausalLM):
    @classmethod
    def read_spec(cls, config: dict) -> ModelSpec:
        return ModelSpec.from_hf_config(config, default_layer_types=qwen_layer_types, qk_norm=True,
                                        moe=_moe(config, shared=False))


class Qwen2MoeForCausalLM(MoECausalLM):
    @classmethod
    def read_spec(cls, config: dict) -> ModelSpec:
        bias = config.get("qkv_bias", True)
        return ModelSpec.from_hf_config(config, default_layer_types=qwen_layer_types, qkv_bias=bias, o_bias=False,
                                        moe=_moe(config, shared=True))
