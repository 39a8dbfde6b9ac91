"""Model architectures and loading from a Hugging Face checkpoint directory."""

from engine.models.causal_lm import CausalLM
from engine.models.loader import load_model, read_hf_config
from engine.models.registry import MODELS, model_class, read_spec
from engine.models.spec import ModelSpec

__all__ = ["MODELS", "CausalLM", "ModelSpec", "load_model", "model_class", "read_hf_config", "read_spec"]
