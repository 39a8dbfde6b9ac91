"""A prompt's tokens counted in the gateway as the engine will count them, for admission (tokens per minute, budget
holds) and its refusals: the registered base model's tokenizer.json and chat template, through the engine's own
torch-free tokenizer (engine.tokenizer) and message shaping, loaded once per checkpoint folder; a tenant's long
segments (a chat's system prompt, its earlier turns) counted once (gateway.segment_counts). A base model whose
folder the gateway cannot read (or has no tokenizer.json) is estimated from bytes instead, an upper bound."""

import asyncio
import functools
import logging
from collections.abc import Callable
from pathlib import Path

from engine.chat_prompt import template_messages
from engine.tokenizer import Tokenizer
from gateway.caller import Target
from gateway.hot_settings import hot
from gateway.openai_request import GenerationRequest
from gateway.segment_counts import MIN_CACHED_CHARS, SegmentCounts

log = logging.getLogger(__name__)

TEMPLATE_OVERHEAD_TOKENS = 16  # per message, for the chat template's markers


@functools.lru_cache(maxsize=32)
def base_tokenizer(checkpoint_dir: str) -> Tokenizer | None:
    """The base model's tokenizer (None: no readable tokenizer.json; a warning, once per folder)."""
    if not (Path(checkpoint_dir) / "tokenizer.json").is_file():
        log.warning("no tokenizer.json readable in %s: admission estimates its prompts from their bytes", checkpoint_dir)
        return None
    try:
        return Tokenizer(checkpoint_dir)
    except Exception:  # a tokenizer file the tokenizers package refuses, a template jinja2 refuses
        log.exception("the tokenizer in %s could not be loaded: admission estimates its prompts from bytes", checkpoint_dir)
        return None


@functools.lru_cache(maxsize=32)
def segment_counts(checkpoint_dir: str) -> SegmentCounts | None:
    """The base model's kept segment counts (None where `base_tokenizer` is None)."""
    tokenizer = base_tokenizer(checkpoint_dir)
    return None if tokenizer is None else SegmentCounts(tokenizer, budget_chars=hot.QUILT_KEPT_SEGMENT_CHARS)


def prompt_tokens(generation: GenerationRequest, tokenizer: Tokenizer) -> int | None:
    """The prompt's tokens as the engine will count them: a chat's messages through the chat template (with its
    tools) and its images' tokens (generation.image_tokens), each text prompt of a completion encoded with special tokens, token prompts as they are. None when the
    template cannot render these messages (the engine then refuses the request and says why)."""
    return _counted(generation, tokenizer, tokenizer.count)


def _counted(generation: GenerationRequest, tokenizer: Tokenizer, count: Callable[..., int]) -> int | None:
    """`prompt_tokens` with `count(text, add_special_tokens=...)`: the tokenizer's, or a tenant's segment counts."""
    if generation.messages is not None:
        try:
            text = tokenizer.apply_chat_template(template_messages(generation.messages), add_generation_prompt=True,
                                                 tools=generation.structure.get("tools"))  # fmt: skip
        except Exception:  # jinja2's errors and the template's own raise_exception()
            return None
        if generation.image_text is not None:  # the engine puts the processor's text in each placeholder's place
            placeholder, expansion = generation.image_text
            return count(text.replace(placeholder, expansion), add_special_tokens=False)
        # the template writes one placeholder per image, which the engine repeats for the image's tokens
        return count(text, add_special_tokens=False) + sum(generation.image_tokens) - len(generation.image_tokens)
    counted = 0
    for prompt in generation.prompts:
        if isinstance(prompt, str):
            counted += count(prompt)  # one call each: a batch of several would split over rayon's pool
        elif isinstance(prompt, list):  # token ids (generation.prompt_token_count's)
            counted += len(prompt)
    return counted


def estimate_prompt_tokens(generation: GenerationRequest, *, prompt_bytes: int | None = None) -> int:
    """An upper bound without tokenizing: byte-level BPE tokenizers never produce more tokens than bytes (and a
    token prompt is counted). `prompt_bytes`: generation.prompt_bytes(), when the caller has it already."""
    messages = len(generation.messages) if generation.messages is not None else 0
    prompt_bytes = generation.prompt_bytes() if prompt_bytes is None else prompt_bytes
    return (prompt_bytes + generation.prompt_token_count() + TEMPLATE_OVERHEAD_TOKENS * (messages + 1)
            + sum(generation.image_tokens))


async def count_prompt_tokens(generation: GenerationRequest, target: Target, *, prompt_bytes: int | None = None,
                              tenant: object = None) -> int:
    """The prompt's tokens with the base model's tokenizer (a long prompt on a worker thread, off the event loop);
    the bytes' upper bound where the gateway has no tokenizer for it or its template can't render the messages.
    `prompt_bytes`: generation.prompt_bytes(), when the caller has it already. `tenant`: whose kept segment counts
    to use (None: none kept)."""
    if prompt_bytes is None:
        prompt_bytes = generation.prompt_bytes()
    tokenizer = base_tokenizer(target.checkpoint_dir)
    counted = None
    if tokenizer is not None:
        if tenant is None or prompt_bytes < MIN_CACHED_CHARS:  # a short prompt has no segment worth keeping
            count = tokenizer.count
        else:
            count = functools.partial(segment_counts(target.checkpoint_dir).count, tenant=tenant)
        prompts = generation.prompts
        if prompt_bytes > hot.QUILT_TOKENIZE_ABOVE_BYTES:
            counted = await asyncio.to_thread(_counted, generation, tokenizer, count)
        elif prompts is not None and len(prompts) == 1 and prompts[0].__class__ is str:  # one text: its count here
            counted = count(prompts[0])  # as `prompt_tokens` counts it
        else:
            counted = _counted(generation, tokenizer, count)
    return estimate_prompt_tokens(generation, prompt_bytes=prompt_bytes) if counted is None else counted
