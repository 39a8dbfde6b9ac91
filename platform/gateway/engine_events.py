"""Reading the engine's NDJSON generate events (engine/server/events.py):

    {"type": "delta", "index", "text", "token_ids", "prompt_tokens"? (a choice's first with tokens), "logprobs"?: [{"token_id", "logprob", "top": {id: logprob}}],
     "prompt_logprobs"?: [the same, the first one's logprob null], "tool_calls"?: [{"index", "id", "name",
     "arguments"}]}
    {"type": "final", "finish_reason", "error", "choices": [{"index", "finish_reason", "error", ...}],
     "usage": {"prompt_tokens", "cached_tokens", "completion_tokens", "spec_proposed_tokens",
               "spec_accepted_tokens", "sampling_steps", "kv_transfer"?: {"lease_id", "blocks_pulled",
               "recomputed"}, ...}}
"""

import functools
from dataclasses import fields
from typing import NamedTuple

from gateway.openai_response import Delta, Usage
from gateway.token_text import Vocabulary

USAGE_COUNTS = ("prompt_tokens", "cached_tokens", "completion_tokens", "spec_proposed_tokens", "spec_accepted_tokens",
                "sampling_steps")  # fmt: skip
_ZEROS = (0,) * len(USAGE_COUNTS)
assert USAGE_COUNTS == tuple(field.name for field in fields(Usage)), "a final's counts are Usage(*counts)"


class Final(NamedTuple):  # a tuple: made in one call, not a frozen dataclass's setattr per field
    finishes: list[tuple]  # each choice's (index, finish reason as the engine gave it, "stop" for none)
    usage: tuple  # the counts named in USAGE_COUNTS (Usage's fields), integers
    error: str | None = None  # the engine failed the request
    error_type: str | None = None  # its kind, e.g. "adapter_unavailable"
    kv_transfer: dict | None = None  # a decode hop's: what the engine did with the lease (for metrics only)


_final = functools.partial(tuple.__new__, Final)  # Final(*fields) in C: a NamedTuple's __new__ is a Python lambda


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


def delta_of(event: dict, *, vocabulary: Vocabulary) -> Delta:
    """A delta event's Delta (its log-probabilities' tokens read in `vocabulary`)."""
    prompt_logprobs, logprobs = event.get("prompt_logprobs"), event.get("logprobs")
    if prompt_logprobs or logprobs:
        logprobs = _logprobs(prompt_logprobs, vocabulary) + _logprobs(logprobs, vocabulary)
    return Delta(
        index=event.get("index", 0), text=event.get("text", ""), logprobs=logprobs or [], finish_reason=None,
        tokens=len(event.get("token_ids") or []), tool_calls=event.get("tool_calls") or [],
        prompt_tokens=event.get("prompt_tokens") or 0,
    )  # fmt: skip


def final_of(event: dict) -> Final:
    """A final event: each choice's finish, the usage counts (a count sent as null or not as an integer read as
    `int`'s), and the engine's failure."""
    usage = event.get("usage") or {}
    finishes = []
    for choice in event.get("choices") or []:  # not a comprehension: its own frame, for one choice or a few
        finishes.append((choice.get("index", 0), choice.get("finish_reason") or "stop"))
    counts = (*map(usage.get, USAGE_COUNTS, _ZEROS),)  # in C
    if {*map(type, counts)} != {int}:  # a count the engine sent as null (or not as an integer)
        counts = tuple([int(usage.get(name) or 0) for name in USAGE_COUNTS])
    transfer = usage.get("kv_transfer")
    if not isinstance(transfer, dict):
        transfer = None
    if event.get("finish_reason") != "error":
        return _final((finishes, counts, None, None, transfer))
    return _final((finishes, counts, event.get("error") or "the engine failed", event.get("error_type") or None,
                   transfer))  # fmt: skip
