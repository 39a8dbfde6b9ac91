"""Which model class serves each Hugging Face architecture; the one place the loader and the engine ask."""

from engine.models.causal_lm import CausalLM
from engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from engine.models.gemma3_vl import Gemma3ForConditionalGeneration
from engine.models.llama import LlamaForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from engine.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from engine.models.qwen3_vl import Qwen3VLForConditionalGeneration
from engine.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from engine.models.spec import ModelSpec

MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
}


def model_class(config: dict) -> type[CausalLM]:
    """The class serving config's architecture; ValueError listing the supported ones otherwise."""
    architecture = (config.get("architectures") or [None])[0]
    if architecture not in MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(MODELS)}")
    return MODELS[architecture]


def read_spec(config: dict) -> ModelSpec:
    """The spec of a checkpoint's config.json; ValueError naming what is supported when the architecture, its
    rope type or its activation is not."""
    return model_class(config).read_spec(config)
