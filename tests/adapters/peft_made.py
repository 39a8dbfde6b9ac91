"""Adapters made by PEFT itself on tiny random models of every served family: the oracle."""

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

from tests.adapters.builders import (
    gemma2_config,
    gemma3_text_config,
    llama_config,
    mistral_config,
    phi3_config,
    qwen2_config,
    qwen3_config,
)

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

SCENARIOS = {
    "llama-mixed-ranks-and-patterns": (
        llama_config,
        LlamaForCausalLM,
        torch.float32,
        dict(
            r=4,
            lora_alpha=16,
            target_modules=ALL,
            # first match wins; "proj" matches nothing (PEFT wants a whole dotted suffix)
            rank_pattern={
                "v_proj": 8,
                "layers.1.mlp.down_proj": 2,
                "mlp.down_proj": 3,
                r"model\.layers\.0\.self_attn\.o_proj": 6,
                "proj": 7,
            },
            alpha_pattern={"o_proj": 32, "layers.0.mlp.gate_proj": 5},
        ),
    ),
    "mistral-rslora-layers-to-transform-bf16": (
        mistral_config,
        MistralForCausalLM,
        torch.bfloat16,
        dict(
            r=8,
            lora_alpha=4,
            use_rslora=True,
            target_modules=["q_proj", "k_proj", "gate_proj"],
            layers_to_transform=[1],
            layers_pattern="layers",
        ),
    ),
    "qwen2-regex-targets-f16": (
        qwen2_config,
        Qwen2ForCausalLM,
        torch.float16,
        dict(
            r=2,
            lora_alpha=7,
            target_modules=r".*\.layers\.\d+\.(self_attn\.(k|o)_proj|mlp\.up_proj)",
            rank_pattern={"up_proj": 5},
        ),
    ),
    "llama-rslora-patterns-exclude-layer-int": (
        llama_config,
        LlamaForCausalLM,
        torch.float32,
        dict(
            r=3,
            lora_alpha=9,
            use_rslora=True,
            target_modules=["q_proj", "up_proj", "down_proj"],
            exclude_modules=r"model\.layers\.0\.self_attn\.q_proj",
            rank_pattern={"down_proj": 16},
            alpha_pattern={"up_proj": 2.5},
        ),
    ),
    "mistral-single-layer-int": (
        mistral_config,
        MistralForCausalLM,
        torch.float32,
        dict(r=16, lora_alpha=16, target_modules=["v_proj", "o_proj"], layers_to_transform=0),
    ),
    "qwen3-all-linear": (
        qwen3_config,
        Qwen3ForCausalLM,
        torch.float32,
        dict(r=4, lora_alpha=8, target_modules="all-linear", rank_pattern={"k_proj": 2}),
    ),
    "gemma2-attention-bf16": (
        gemma2_config,
        Gemma2ForCausalLM,
        torch.bfloat16,
        dict(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    ),
    "gemma3-text-every-projection": (
        gemma3_text_config,
        Gemma3ForCausalLM,
        torch.float32,
        dict(r=2, lora_alpha=4, target_modules=ALL, alpha_pattern={"down_proj": 1}),
    ),
    "phi3-all-linear-fused": (
        phi3_config,
        Phi3ForCausalLM,
        torch.float32,
        dict(r=4, lora_alpha=8, target_modules="all-linear", rank_pattern={"qkv_proj": 6}),
    ),
    "phi3-fused-names-rslora": (
        phi3_config,
        Phi3ForCausalLM,
        torch.float32,
        dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["qkv_proj", "gate_up_proj"]),
    ),
}


@dataclass
class PeftMade:
    model: PeftModel
    directory: Path
    base_config: dict
    lora: dict


def make(name: str, directory: Path) -> PeftMade:
    config_factory, model_class, dtype, lora = SCENARIOS[name]
    torch.manual_seed(0)
    config = config_factory()
    base = model_class(config).to(dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The following rank_pattern keys did not match")
        model = get_peft_model(
            base, LoraConfig(init_lora_weights=False, **lora), autocast_adapter_dtype=False
        )
    model.save_pretrained(directory)
    return PeftMade(model=model, directory=directory, base_config=config.to_dict(), lora=lora)


def lora_modules(model: PeftModel) -> dict[str, LoraLayer]:
    """PEFT's LoRA layers keyed like Quilt's: "layers.{i}.{module}"."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            parts = name.split(".")
            layer = parts[parts.index("layers") + 1]
            found[f"layers.{layer}.{parts[-1]}"] = module
    return found
