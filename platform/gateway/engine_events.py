"""Reading the engine's generate events (engine.contract.events: Delta and Final, decoded by their structs).

`decode_event` is how the engine client reads each NDJSON line; what it gives the relay and the exchange read:
a delta's text, tokens and tool calls, a final event's finishes, usage counts, failure and KV transfer."""

from typing import NamedTuple

import msgspec

from engine.contract import events
from gateway.openai_response import Delta, Usage
from gateway.token_text import Vocabulary

USAGE_COUNTS = ("prompt_tokens", "cached_tokens", "completion_tokens", "spec_proposed_tokens", "spec_accepted_tokens",
                "sampling_steps")  # Usage's fields, as FinalUsage names them  # fmt: skip
decode_event = msgspec.json.Decoder(events.StreamEvent).decode  # msgspec.DecodeError (or its ValidationError)
# for a line that is not an event of this contract: the field it refuses named by its path


class Ending(NamedTuple):
    finishes: list[tuple]  # each choice's (index, finish reason as the engine gave it, "stop" for none)
    usage: Usage
    error: str | None = None  # the engine failed the request
    error_type: str | None = None  # its kind, e.g. "adapter_unavailable"
    kv_transfer: events.KVPull | None = None  # a decode hop's: what the engine did with the lease (for metrics only)


def _token(vocabulary: Vocabulary, token_id: int, logprob: float | None) -> dict:
    piece = vocabulary.piece(token_id)
    return {"token": piece.text, "bytes": list(piece.bytes), "whole": piece.whole, "logprob": logprob}


def _logprobs(entries: list[events.Logprob] | None, vocabulary: Vocabulary) -> list[dict]:
    out = []
    for entry in entries or []:
        top = sorted(entry.top.items(), key=lambda item: -item[1])
        out.append(_token(vocabulary, entry.token_id, entry.logprob) | {
            "top_logprobs": None if entry.logprob is None else [_token(vocabulary, t, lp) for t, lp in top],
        })  # fmt: skip
    return out


def delta_of(event: events.Delta, *, vocabulary: Vocabulary) -> Delta:
    """A delta event's Delta (its log-probabilities' tokens read in `vocabulary`)."""
    logprobs = event.logprobs
    if event.prompt_logprobs or logprobs:
        logprobs = _logprobs(event.prompt_logprobs, vocabulary) + _logprobs(logprobs, vocabulary)
    return Delta(
        index=event.index, text=event.text, logprobs=logprobs or [], finish_reason=None, tokens=len(event.token_ids),
        tool_calls=event.tool_calls or [], prompt_tokens=event.prompt_tokens or 0,
    )  # fmt: skip


def final_of(event: events.Final) -> Ending:
    """A final event: each choice's finish, the usage counts, and the engine's failure."""
    usage = event.usage
    finishes = []
    for choice in event.choices:  # not a comprehension: its own frame, for one choice or a few
        finishes.append((choice.index, choice.finish_reason or "stop"))
    counts = Usage(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens, usage.spec_proposed_tokens,
                   usage.spec_accepted_tokens, usage.sampling_steps)  # fmt: skip
    if event.finish_reason != "error":
        return Ending(finishes, counts, None, None, usage.kv_transfer)
    return Ending(finishes, counts, event.error or "the engine failed", event.error_type or None, usage.kv_transfer)
