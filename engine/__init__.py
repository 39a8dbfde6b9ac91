"""Quilt's inference engine: paged KV cache, continuous batching and batched per-token LoRA."""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.outputs import Logprob, RequestOutput, Usage
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "Logprob", "RequestOutput", "SamplingParams", "Usage"]
