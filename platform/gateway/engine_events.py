"""Reading the engine's NDJSON generate events (engine/server/events.py):

    {"type": "delta", "index", "text", "token_ids", "logprobs"?: [{"token_id", "logprob", "top": {id: logprob}}],
     "prompt_logprobs"?: [the same, the first one's logprob null], "tool_calls"?: [{"index", "id", "name",
     "arguments"}]}
    {"type": "final", "finish_reason", "error", "choices": [{"index", "finish_reason", "error", ...}],
     "usage": {"prompt_tokens", "cached_tokens", "completion_tokens", "spec_proposed_tokens",
               "spec_accepted_tokens", "sampling_steps", "kv_transfer"?: {"lease_id", "blocks_pulled",
               "recomputed"}, ...}}
"""

from typing import NamedTuple

from gateway.openai_response import Delta
from gateway.token_text import Vocabulary

USAGE_COUNTS = ("prompt_tokens", "cached_tokens", "completion_tokens", "spec_proposed_tokens", "spec_accepted_tokens",
                "sampling_steps")  # fmt: skip
_ZEROS = (0,) * len(USAGE_COUNTS)


class Read(NamedTuple):  # a tuple: made in one call per event, not a frozen dataclass's setattr per field
    deltas: list[Delta]
    usage: dict | None = None
    error: str | None = None  # the engine failed the request
    error_type: str | None = None  # its kind, e.g. "adapter_unavailable"
    kv_transfer: dict | None = None  # a decode hop's: what the engine did with the lease (for metrics only)


def _token(vocabulary: Vocabulary, token_id: int, logprob: float | None) -> dict:
    piece = vocabulary.piece(token_id)
    return {"token": piece.text, "bytes": list(piece.bytes), "whole": piece.whole, "logprob": logprob}


def _logprobs(entries, vocabulary: Vocabulary) -> list[dict]:
    out = []
    for entry in entries or []:
        top = sorted(((int(t), lp) for t, lp in (entry.get("top") or {}).items()), key=lambda item: -item[1])
        out.append(_token(vocabulary, entry["token_id"], entry["logprob"]) | {
            "top_logprobs": None if entry["logprob"] is None else [_token(vocabulary, t, lp) for t, lp in top],
        })  # fmt: skip
    return out


def event_read(event: dict, *, vocabulary: Vocabulary) -> Read:
    kind = event.get("type")
    if kind == "delta":
        prompt_logprobs, logprobs = event.get("prompt_logprobs"), event.get("logprobs")
        if prompt_logprobs or logprobs:
            logprobs = _logprobs(prompt_logprobs, vocabulary) + _logprobs(logprobs, vocabulary)
        delta = Delta(
            index=event.get("index", 0), text=event.get("text", ""), logprobs=logprobs or [], finish_reason=None,
            tokens=len(event.get("token_ids") or []), tool_calls=event.get("tool_calls") or [],
        )  # fmt: skip
        return Read([delta])
    if kind == "final":
        usage = event.get("usage") or {}
        deltas = [
            Delta(index=c.get("index", 0), text="", logprobs=[], finish_reason=c.get("finish_reason") or "stop")
            for c in event.get("choices") or []
        ]
        error = event.get("error") if event.get("finish_reason") == "error" else None
        counts = dict(zip(USAGE_COUNTS, map(usage.get, USAGE_COUNTS, _ZEROS), strict=True))  # in C
        if {*map(type, counts.values())} != {int}:  # a count the engine sent as null (or not as an integer)
            counts = {name: int(usage.get(name) or 0) for name in USAGE_COUNTS}
        failed = event.get("finish_reason") == "error"
        transfer = usage.get("kv_transfer")
        return Read(deltas=deltas, usage=counts, error=error or ("the engine failed" if failed else None),
                    error_type=(event.get("error_type") or None) if failed else None,
                    kv_transfer=transfer if isinstance(transfer, dict) else None)  # fmt: skip
    return Read([])
