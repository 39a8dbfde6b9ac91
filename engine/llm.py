"""The offline API: load a model, add adapters, generate for a list of prompts."""

import itertools
import time
from pathlib import Path

import torch

from engine.chat_prompt import render_chat
from engine.config import EngineConfig
from engine.grammar import GrammarSpec
from engine.images import ImageFeatures
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, merge_choices
from engine.sampling_params import SamplingParams

_batch_ids = itertools.count()


class LLM:
    """`close()` (or leaving a `with LLM(...) as llm:` block) frees the model, the KV pool and the adapters at
    once, device memory included; so does dropping the last reference (nothing in the engine is held in a
    reference cycle or by a thread)."""

    def __init__(self, model: str | Path, device: str = "cpu", **config_fields) -> None:
        self.engine: LLMEngine | None = LLMEngine(EngineConfig(model=str(model), device=device, **config_fields))
        self.adapters: dict[str, str] = {}  # name -> digest

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop the engine and let go of it; this LLM runs nothing after (a second close does nothing)."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        engine.shutdown()
        on_cuda = engine.device.type == "cuda"
        del engine  # the last reference: the weights, the page pool and the adapters' tiers go with it
        if on_cuda:
            torch.cuda.empty_cache()  # back to the driver, for another process (this one reuses its cache anyway)

    def _open_engine(self) -> LLMEngine:
        if self.engine is None:
            raise RuntimeError("this LLM is closed")
        return self.engine

    @property
    def tokenizer(self):
        return self._open_engine().tokenizer

    def add_adapter(self, name: str, path: str | Path) -> str:
        digest = self._open_engine().add_adapter(path)
        self.adapters[name] = digest
        return digest

    def generate(
        self,
        prompts: list[str | list[int] | list[dict]],
        sampling: SamplingParams | list[SamplingParams] | None = None,
        adapters: list[str | None] | None = None,
        tenants: list[str] | None = None,
        grammars: list[GrammarSpec | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order: completion 0 with every completion in `choices` and the
        request's usage (engine.outputs.merge_choices). A prompt is text, token ids, or OpenAI-shaped chat
        messages, rendered by the model's chat template; their content parts may carry images as
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}. grammars: what constrains each
        prompt's output (None: nothing), compiled before any request starts."""
        self._open_engine()
        count = len(prompts)
        samplings = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * count
        adapters = adapters or [None] * count
        tenants = tenants or ["default"] * count
        grammars = grammars or [None] * count
        if not len(samplings) == len(adapters) == len(tenants) == len(grammars) == count:
            raise ValueError("sampling, adapters, tenants and grammars must have one entry per prompt")
        if any(grammars) and self.engine.grammars is None:
            raise ValueError("this model has no tokenizer.json: its outputs cannot be constrained")
        compiled = [self.engine.grammars.compile(spec) if spec else None for spec in grammars]
        unknown = [name for name in adapters if name is not None and name not in self.adapters]
        if unknown:
            raise ValueError(f"unknown adapter {unknown[0]!r}; add it with add_adapter first")
        prepared = [self._prompt(prompt) for prompt in prompts]  # every image decoded before any request starts
        batch = next(_batch_ids)
        request_ids = []
        for i, ((prompt, images), params, name, tenant, grammar) in enumerate(
                zip(prepared, samplings, adapters, tenants, compiled, strict=True)):
            request_id = f"offline-{batch}-{i}"
            self.engine.add_request(
                request_id, list(prompt), params, adapter=self.adapters.get(name), tenant=tenant, grammar=grammar,
                images=images,
            )
            request_ids.append(request_id)
        final: dict[tuple[str, int], RequestOutput] = {}
        while self.engine.has_unfinished():
            steps = self.engine.num_steps
            for output in self.engine.step():
                if output.finished:
                    final[(output.request_id, output.index)] = output
            if self.engine.num_steps == steps:
                time.sleep(0.001)  # nothing could run: adapters are still loading
        results = []
        for request_id, params in zip(request_ids, samplings, strict=True):
            results.append(merge_choices([final[(request_id, index)] for index in range(params.n)]))
        return results

    def _prompt(self, prompt: str | list[int] | list[dict]) -> tuple[list[int], list[ImageFeatures]]:
        """A prompt's token ids and images; ValueError (engine.images.ImageError for an image) when it is unusable."""
        is_chat = bool(prompt) and isinstance(prompt[0], dict)
        if (isinstance(prompt, str) or is_chat) and self.tokenizer is None:
            raise ValueError("this model has no tokenizer.json: pass prompts as token ids")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), []
        return self._chat(prompt) if is_chat else (list(prompt), [])

    def _chat(self, messages: list[dict]) -> tuple[list[int], list[ImageFeatures]]:
        """Chat messages' token ids and images, as the HTTP server renders them (engine.chat_prompt)."""
        return render_chat(self.tokenizer, messages, vision=self._open_engine().image_inputs)
