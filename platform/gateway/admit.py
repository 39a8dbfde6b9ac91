"""Admitting one request: its context checked, its prompt's tokens counted, and a hold on the tenant's (and key's)
limits and budget for its estimate; an Exchange for it, or the refusal."""

from engine.contract import CONTEXT_LENGTH_EXCEEDED
from gateway import metrics
from gateway.admission import admission_admit, spend_to_micros, spend_to_picos
from gateway.budget_notices import budget_exhausted
from gateway.caller import Caller, Target
from gateway.errors import invalid
from gateway.exchange import Exchange, settles_of
from gateway.openai_request import GenerationRequest
from gateway.prompt_tokens import count_prompt_tokens
from gateway.refusals import ratelimit_headers, refusal
from gateway.request_images import load_images
from gateway.serving import serving
from metering.pricing import request_price

WINDOW_REASONS = frozenset(("requests", "key_requests"))  # refusals a settle does not change: requests per minute


def context_check(generation: GenerationRequest, target: Target) -> None:
    """max_tokens that leaves no room for a prompt is refused here, as OpenAI refuses it; one that does, with the
    prompt, is the engine's to check (it counts the prompt's tokens)."""
    if generation.max_tokens_given and generation.max_tokens >= target.max_context:
        raise invalid(
            f"max_tokens is too large: {generation.max_tokens}. This model's maximum context length is "
            f"{target.max_context} tokens, and the prompt and completion must fit in it together.",
            param="max_tokens", code=CONTEXT_LENGTH_EXCEEDED,
        )  # fmt: skip



async def admit(
    *, request_id: str, caller: Caller, target: Target, generation: GenerationRequest, received: float
) -> tuple[Exchange, dict[str, str]]:
    if generation.max_tokens_given and generation.max_tokens >= target.max_context:
        context_check(generation, target)  # refused
    shared = serving(caller, target)
    max_tokens = min(generation.max_tokens or caller.default_max_tokens, target.max_context)
    if "min_tokens" in generation.sampling and generation.sampling["min_tokens"] > max_tokens:
        raise invalid(f"'min_tokens' ({generation.sampling['min_tokens']}) must be less than or equal to the request's "
                      f"max_tokens, {max_tokens} (the plan's default).", param="min_tokens")  # fmt: skip
    if generation.image_params:  # each checked, and its tokens counted, before anything is held
        await load_images(generation, target)
    choices, prompt_bytes = generation.num_choices, generation.prompt_bytes()
    prompt_tokens = await count_prompt_tokens(generation, target, prompt_bytes=prompt_bytes,
                                             tenant=caller.tenant_id)  # fmt: skip
    tokens = prompt_tokens + choices * max_tokens
    spend = request_price(  # what caller.spend prices, with the rates the pair keeps
        rates=shared.rates, prompt_tokens=prompt_tokens, cached_tokens=0, completion_tokens=choices * max_tokens
    )
    decision, lease = await admission_admit(
        tenant_id=caller.tenant_id, request_id=request_id, tokens=tokens, spend_micros=spend_to_micros(spend),
        key_spend_picos=spend_to_picos(spend), limits=caller.limits,
    )  # fmt: skip
    if not decision.admitted and decision.reason not in WINDOW_REASONS and await settles_of(caller.tenant_id):
        # a request of the tenant's whose stream has ended still held its room: its client may ask again at once
        decision, lease = await admission_admit(
            tenant_id=caller.tenant_id, request_id=request_id, tokens=tokens, spend_micros=spend_to_micros(spend),
            key_spend_picos=spend_to_picos(spend), limits=caller.limits,
        )  # fmt: skip
    headers = ratelimit_headers(caller, decision)
    if not decision.admitted:
        budget_exhausted(tenant_id=caller.tenant_id, reason=decision.reason)
        metrics.refusals.labels(str(caller.tenant_id), decision.reason).inc()
        raise refusal(decision, headers, tokens=tokens, limits=caller.limits, prompt_tokens=prompt_tokens)
    exchange = Exchange(
        request_id=request_id, serving=shared, generation=generation, max_tokens=max_tokens, choices=choices,
        prompt_bytes=prompt_bytes, hold_tokens=tokens, hold_spend=spend, received=received,
    )  # fmt: skip
    if lease is not None:
        exchange.hold_lease = lease
    return exchange, headers
