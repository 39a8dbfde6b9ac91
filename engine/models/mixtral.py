"""Mixtral: the Mistral layer with experts on every layer, top k of the softmax renormalised. Its checkpoint
names the MoE block `block_sparse_moe` and an expert's gate/down/up `w1`/`w2`/`w3`; they are read as the
Qwen-MoE names (`checkpoint_parts`), so sharding and loading are those of every MoE family."""

import re

from engine.models.moe import MoECausalLM, num_experts
from engine.models.spec import ModelSpec, MoESpec, every_layer_windowed

_EXPERT = re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.(\w+)$")  # weight, or a quantized kind
_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


class MixtralForCausalLM(MoECausalLM):
    @classmethod
    def read_spec(cls, config: dict) -> ModelSpec:
        moe = MoESpec(num_experts=num_experts(config), top_k=config["num_experts_per_tok"],
                      intermediate_size=config["intermediate_size"], renormalize=True,
                      sparse_layers=(True,) * config["num_hidden_layers"])
        return ModelSpec.from_hf_config(config, default_layer_types=every_layer_windowed, moe=moe)

    def checkpoint_parts(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, int, int]] | None:
        match = _EXPERT.match(name)
        if match:
            prefix, expert, w, kind = match.groups()
            return [(f"{prefix}.mlp.experts.{expert}.{_PROJ[w]}.{kind}", 0, shape[0])]
        if ".block_sparse_moe.gate." in name:
            return [(name.replace(".block_sparse_moe.", ".mlp."), 0, shape[0])]
        return super().checkpoint_parts(name, shape)
