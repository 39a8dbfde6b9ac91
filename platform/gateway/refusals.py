"""What a refused or admitted request's answer says about the tenant's limits: the x-ratelimit-* headers and
the OpenAI-shaped refusal (429 with Retry-After) for each admission reason."""

import math

from gateway.admission import Decision, seconds_to_month_end
from gateway.caller import Caller
from gateway.errors import ApiError


def ratelimit_headers(caller: Caller, decision: Decision) -> dict[str, str]:
    limits = caller.limits
    reset = f"{decision.reset_ms / 1000:.3f}s"
    return {
        "x-ratelimit-limit-requests": str(limits.requests_per_minute),
        "x-ratelimit-limit-tokens": str(limits.tokens_per_minute),
        "x-ratelimit-remaining-requests": str(max(0, limits.requests_per_minute - decision.window_requests)),
        "x-ratelimit-remaining-tokens": str(max(0, limits.tokens_per_minute - decision.window_tokens)),
        "x-ratelimit-reset-requests": reset,
        "x-ratelimit-reset-tokens": reset,
    }


def refusal(decision: Decision, headers: dict[str, str], *, tokens: int) -> ApiError:
    retry_after = 1
    if decision.reason == "requests":
        message, code = "Rate limit reached: too many requests per minute for your plan.", "rate_limit_exceeded"
        retry_after = math.ceil(decision.reset_ms / 1000)
    elif decision.reason == "tokens":
        message, code = f"Rate limit reached: this request needs {tokens} tokens of your per-minute token limit.", "rate_limit_exceeded"
        retry_after = math.ceil(decision.reset_ms / 1000)
    elif decision.reason == "concurrency":
        message, code = "Rate limit reached: too many concurrent requests for your plan.", "rate_limit_exceeded"
    elif decision.reason == "budget_held":
        message, code = "Requests in flight hold the rest of your monthly budget; retry when they finish.", "rate_limit_exceeded"
    elif decision.reason == "key_requests":
        message, code = "Rate limit reached: too many requests per minute for this API key.", "rate_limit_exceeded"
        retry_after = math.ceil(decision.reset_ms / 1000)
    elif decision.reason == "key_tokens":
        message, code = f"Rate limit reached: this request needs {tokens} tokens of this API key's per-minute token limit.", "rate_limit_exceeded"
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
