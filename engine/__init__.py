"""Quilt's inference engine: paged KV cache, continuous batching and batched per-token LoRA.

The public names load lazily so that torch-free parts (the usage-event schema the platform imports)
can be imported without torch.
"""

import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "EngineConfig": "engine.config",
    "Logprob": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "Usage": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
