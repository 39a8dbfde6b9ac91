"""What a refused or admitted request's answer says about the tenant's limits: the x-ratelimit-* headers and
the OpenAI-shaped refusal (429 with Retry-After) for each admission reason."""

import math

from gateway.admission import UNLIMITED, Decision, Limits, seconds_to_month_end
from gateway.caller import Caller
from gateway.errors import ApiError

KEY_WINDOW_REASONS = ("key_requests", "key_tokens")  # refusals whose window counts are the key's, not the tenant's


def ratelimit_headers(caller: Caller, decision: Decision) -> dict[str, str]:
    """The limits of the window that decided: the tenant's, or, when the API key's own per-minute limit refused the
    call, the key's (a kind the key does not limit itself is left out: its counts are the tenant's, not known here).
    An admitted call reports, of each kind, the nearer of the two: the key's where it has fewer left than the tenant's
    (or the tenant does not limit that kind), else the tenant's."""
    limits = caller.limits
    requests, tokens = limits.requests_per_minute, limits.tokens_per_minute
    used_requests, used_tokens = decision.window_requests, decision.window_tokens
    if decision.reason in KEY_WINDOW_REASONS:
        requests, tokens = limits.key_requests_per_minute, limits.key_tokens_per_minute
    elif decision.admitted:
        key_requests, key_tokens = limits.key_requests_per_minute, limits.key_tokens_per_minute
        if key_requests != UNLIMITED and (
            requests == UNLIMITED or key_requests - decision.key_window_requests < requests - used_requests
        ):
            requests, used_requests = key_requests, decision.key_window_requests
        if key_tokens != UNLIMITED and (
            tokens == UNLIMITED or key_tokens - decision.key_window_tokens < tokens - used_tokens
        ):
            tokens, used_tokens = key_tokens, decision.key_window_tokens
    reset = f"{decision.reset_ms / 1000:.3f}s"
    if requests != UNLIMITED and tokens != UNLIMITED:  # most plans limit both: one dict, in the order below
        return {
            "x-ratelimit-limit-requests": str(requests),
            "x-ratelimit-remaining-requests": str(max(0, requests - used_requests)),
            "x-ratelimit-reset-requests": reset,
            "x-ratelimit-limit-tokens": str(tokens),
            "x-ratelimit-remaining-tokens": str(max(0, tokens - used_tokens)),
            "x-ratelimit-reset-tokens": reset,
        }
    headers = {} if requests == UNLIMITED else {
        "x-ratelimit-limit-requests": str(requests),
        "x-ratelimit-remaining-requests": str(max(0, requests - used_requests)),
        "x-ratelimit-reset-requests": reset,
    }  # fmt: skip
    if tokens != UNLIMITED:
        headers["x-ratelimit-limit-tokens"] = str(tokens)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, tokens - used_tokens))
        headers["x-ratelimit-reset-tokens"] = reset
    return headers


def refusal(decision: Decision, headers: dict[str, str], *, tokens: int, limits: Limits, prompt_tokens: int = 0) -> ApiError:
    """`tokens`: what the request needs (its prompt's tokens, counted with the base model's tokenizer, plus each
    choice's max_tokens)."""
    retry_after = 1
    if decision.reason == "requests":
        message, code = "Rate limit reached: too many requests per minute for your plan.", "rate_limit_exceeded"
        retry_after = math.ceil(decision.reset_ms / 1000)
    elif decision.reason == "tokens":
        limit = limits.tokens_per_minute
        message = (f"Rate limit reached: this request needs {tokens} tokens ({prompt_tokens} in the prompt) and your "
                   f"plan has {max(0, limit - decision.window_tokens)} of its {limit} tokens per minute left.")
        code = "rate_limit_exceeded"
        retry_after = math.ceil(decision.reset_ms / 1000)
    elif decision.reason == "concurrency":
        message, code = "Rate limit reached: too many concurrent requests for your plan.", "rate_limit_exceeded"
    elif decision.reason == "budget_held":
        message, code = "Requests in flight hold the rest of your monthly budget; retry when they finish.", "rate_limit_exceeded"
    elif decision.reason == "key_requests":
        message, code = "Rate limit reached: too many requests per minute for this API key.", "rate_limit_exceeded"
        retry_after = math.ceil(decision.reset_ms / 1000)
    elif decision.reason == "key_tokens":
        limit = limits.key_tokens_per_minute
        message = (f"Rate limit reached: this request needs {tokens} tokens ({prompt_tokens} in the prompt) and this "
                   f"API key has {max(0, limit - decision.window_tokens)} of its {limit} tokens per minute left.")
        code = "rate_limit_exceeded"
        retry_after = math.ceil(decision.reset_ms / 1000)
    elif decision.reason == "key_budget_held":
        message, code = "Requests in flight hold the rest of this API key's monthly budget; retry when they finish.", "rate_limit_exceeded"
    elif decision.reason == "key_budget_spend":
        message, code = "This API key exceeded its monthly budget; ask an admin to raise it, or use another key.", "insufficient_quota"
        retry_after = seconds_to_month_end()
    else:
        what = "token budget" if decision.reason == "budget_tokens" else "spend limit"
        message, code = f"You exceeded your monthly {what}: this request may need up to {tokens} tokens.", "insufficient_quota"
        retry_after = seconds_to_month_end()
    kind = "insufficient_quota" if code == "insufficient_quota" else "rate_limit_error"
    return ApiError(429, message, code=code, type=kind, headers=headers | {"Retry-After": str(retry_after)})
