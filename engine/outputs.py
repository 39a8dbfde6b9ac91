"""What the engine hands back for a request."""

import dataclasses
from dataclasses import dataclass, field


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: float = 0.0
    ttft_ms: float | None = None
    gpu_ms: float = 0.0
    spec_proposed_tokens: int = 0  # speculative decoding: tokens proposed, and accepted by verification
    spec_accepted_tokens: int = 0
    sampling_steps: int = 0  # steps that gave tokens: completion_tokens / sampling_steps is tokens per step


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # the top-k alternatives, token id -> logprob


@dataclass
class RequestOutput:
    """One completion of a request. With n > 1 a request has completions index 0..n-1; the
    offline API returns index 0 with all of them in `choices`, the online `step()` one entry each."""

    request_id: str
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    usage: Usage
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None
    error: str | None = None
    error_type: str | None = None  # "adapter_unavailable" when the request's adapter could not be loaded
    choices: list["RequestOutput"] = field(default_factory=list)


def merge_choices(outputs: list[RequestOutput]) -> RequestOutput:
    """The one place a request's n completions (final outputs, by index) become one answer, for the offline
    LLM and the server alike: completion 0 carrying all of them in `choices` and the request's usage (the
    prompt counted once, completions, GPU time summed, the earliest queue time and first token)."""
    first = outputs[0]
    ttfts = [o.usage.ttft_ms for o in outputs if o.usage.ttft_ms is not None]
    usage = Usage(
        prompt_tokens=first.usage.prompt_tokens, cached_tokens=first.usage.cached_tokens,
        completion_tokens=sum(o.usage.completion_tokens for o in outputs),
        queue_ms=min(o.usage.queue_ms for o in outputs), ttft_ms=min(ttfts) if ttfts else None,
        gpu_ms=sum(o.usage.gpu_ms for o in outputs),
        spec_proposed_tokens=sum(o.usage.spec_proposed_tokens for o in outputs),
        spec_accepted_tokens=sum(o.usage.spec_accepted_tokens for o in outputs),
        sampling_steps=sum(o.usage.sampling_steps for o in outputs),
    )
    return dataclasses.replace(first, usage=usage, choices=list(outputs))


def sum_usage(usages: list[Usage]) -> Usage:
    """The usage of a batch of prompts, each its own request's (merge_choices): counts and GPU time summed,
    the earliest queue time and first token."""
    if len(usages) == 1:
        return usages[0]
    ttfts = [u.ttft_ms for u in usages if u.ttft_ms is not None]
    counts = ("prompt_tokens", "cached_tokens", "completion_tokens", "gpu_ms", "spec_proposed_tokens",
              "spec_accepted_tokens", "sampling_steps")
    return Usage(**{name: sum(getattr(u, name) for u in usages) for name in counts},
                 queue_ms=min(u.queue_ms for u in usages), ttft_ms=min(ttfts) if ttfts else None)
