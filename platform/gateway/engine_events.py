"""Reading the engine's NDJSON generate events: token deltas per completion, then a final event with each
completion's finish reason and the request's usage."""

from gateway.openai_response import Delta

FINAL_TYPES = ("done", "final", "finish")


def _logprobs(entries) -> list[dict]:
    out = []
    for entry in entries or []:
        top = entry.get("top_logprobs") or entry.get("top") or []
        if isinstance(top, dict):
            top = [{"token": token, "logprob": logprob} for token, logprob in top.items()]
        out.append({"token": entry.get("token", ""), "logprob": entry.get("logprob", 0.0), "top_logprobs": top})
    return out


def deltas_of(event: dict) -> list[Delta]:
    kind = event.get("type")
    if kind == "delta":
        return [
            Delta(
                index=event.get("index", 0), text=event.get("text", ""), logprobs=_logprobs(event.get("logprobs")),
                finish_reason=event.get("finish_reason"), tokens=len(event.get("token_ids") or []),
            )
        ]  # fmt: skip
    if kind in FINAL_TYPES:
        choices = event.get("choices") or [event]
        return [
            Delta(index=c.get("index", 0), text="", logprobs=[], finish_reason=c.get("finish_reason") or "stop")
            for c in choices
        ]
    return []


def usage_of(event: dict) -> dict | None:
    usage = event.get("usage") if event.get("type") in FINAL_TYPES else None
    if not usage:
        return None
    return {
        "prompt_tokens": int(usage.get("prompt_tokens", 0)),
        "cached_tokens": int(usage.get("cached_tokens", 0)),
        "completion_tokens": int(usage.get("completion_tokens", 0)),
    }


def error_of(event: dict) -> str | None:
    return event.get("message") or "engine error" if event.get("type") == "error" else None
