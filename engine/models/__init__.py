"""Model architectures and loading from a Hugging Face checkpoint directory."""

from engine.models.llama import LlamaForCausalLM, ModelArgs
from engine.models.loader import load_model, read_hf_config

__all__ = ["LlamaForCausalLM", "ModelArgs", "load_model", "read_hf_config"]
