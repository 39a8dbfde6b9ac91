"""Shapes of the LoRA-targetable projections of a Llama-family base model, read from its config.json."""

from dataclasses import dataclass
from typing import Any

from adapters.errors import AdapterError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_MODULES + MLP_MODULES


def module_parent(module: str) -> str:
    return "self_attn" if module in ATTENTION_MODULES else "mlp"


def peft_module_key(layer: int, module: str) -> str:
    """The module's name inside the `*ForCausalLM` model, which is what PEFT matches its patterns against."""
    return f"model.layers.{layer}.{module_parent(module)}.{module}"


@dataclass(frozen=True)
class BaseShapes:
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "BaseShapes":
        if not isinstance(config, dict):
            raise AdapterError("unsupported_base_model", "the base model's config.json is not a JSON object")
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise AdapterError(
                "unsupported_base_model",
                f"base model type {model_type!r} is not served; supported: {', '.join(SUPPORTED_MODEL_TYPES)}",
            )
        hidden = _positive_int(config, "hidden_size")
        heads = _positive_int(config, "num_attention_heads")
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        shapes = cls(
            model_type=model_type,
            num_layers=_positive_int(config, "num_hidden_layers"),
            hidden_size=hidden,
            intermediate_size=_positive_int(config, "intermediate_size"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
        )
        if not isinstance(kv_heads, int) or not isinstance(head_dim, int) or heads % kv_heads:
            raise AdapterError(
                "unsupported_base_model",
                f"base config has {heads} attention heads, {kv_heads!r} key/value heads and head_dim {head_dim!r}",
            )
        return shapes

    def in_out(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of the projection's nn.Linear."""
        q_width = self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        return {
            "q_proj": (self.hidden_size, q_width),
            "k_proj": (self.hidden_size, kv_width),
            "v_proj": (self.hidden_size, kv_width),
            "o_proj": (q_width, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }[module]

    def lora_shapes(self, module: str, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """Expected (lora_A, lora_B) shapes in PEFT orientation: A [r, in], B [out, r]."""
        in_features, out_features = self.in_out(module)
        return (rank, in_features), (out_features, rank)

    def named_modules(self) -> dict[str, str]:
        """Every module name of the `*ForCausalLM` model PEFT could be pointed at, mapped to what it is."""
        names = {"": "model", "model": "model", "model.layers": "layer list", "model.rotary_emb": "rotary"}
        names |= {"model.embed_tokens": "embedding", "lm_head": "lm_head", "model.norm": "norm"}
        for layer in range(self.num_layers):
            prefix = f"model.layers.{layer}"
            names |= {prefix: "decoder layer", f"{prefix}.self_attn": "attention", f"{prefix}.mlp": "MLP"}
            for module in PROJECTIONS:
                names[peft_module_key(layer, module)] = module
            names[f"{prefix}.input_layernorm"] = "norm"
            names[f"{prefix}.post_attention_layernorm"] = "norm"
            names[f"{prefix}.mlp.act_fn"] = "activation"
        return names


def _positive_int(config: dict[str, Any], field: str) -> int:
    value = config.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AdapterError(
            "unsupported_base_model", f"base config field {field!r} is {value!r}, expected a positive integer"
        )
    return value
