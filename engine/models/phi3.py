"""Phi-3, Phi-3.5, Phi-4 and Phi-4-mini (transformers' Phi3ForCausalLM): Llama's decoder layer, with the
checkpoint's q/k/v and gate/up already fused, LongRoPE, a partial rotary factor (Phi-4-mini: 0.75) and, where
the config sets one, a sliding window on every layer."""

from engine.models.llama import LlamaForCausalLM
from engine.models.spec import ModelSpec, every_layer_windowed

# the checkpoint's fused projections and their slices, in row order
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_LONGROPE_NAMES = ("longrope", "su", "yarn")  # transformers reads Phi-3's "su" and "yarn" as longrope


class Phi3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def read_spec(cls, config: dict) -> ModelSpec:
        return ModelSpec.from_hf_config(_with_longrope(config), default_layer_types=every_layer_windowed)

    def checkpoint_parts(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, int, int]] | None:
        """A fused checkpoint tensor as the split ones it holds, (name, first row, end row), so that sharding
        and loading see the q/k/v and gate/up of every other family."""
        module, _, kind = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if proj not in _FUSED:
            return None
        spec = self.spec
        widths = {"q_proj": spec.num_heads * spec.head_dim, "k_proj": spec.num_kv_heads * spec.head_dim,
                  "v_proj": spec.num_kv_heads * spec.head_dim, "gate_proj": spec.intermediate_size,
                  "up_proj": spec.intermediate_size}  # fmt: skip
        parts, row = [], 0
        for split in _FUSED[proj]:
            parts.append((f"{parent}.{split}.{kind}", row, row + widths[split]))
            row += widths[split]
        if row != shape[0]:
            raise ValueError(f"checkpoint tensor {name} has {shape[0]} rows; this config needs {row}")
        return parts


def _with_longrope(config: dict) -> dict:
    """Older Phi-3 configs keep original_max_position_embeddings beside rope_scaling and may call LongRoPE "su"
    or "yarn"; transformers reads all of them as longrope with that original length, and so does this."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type")) not in _LONGROPE_NAMES:
        return config
    original = rope.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    return {**config, key: {**rope, "rope_type": "longrope", "type": "longrope",
                            "original_max_position_embeddings": original}}  # fmt: skip
