"""What the gateway reads from the engine's generate events: a delta's text, tokens and tool calls; a final event's
finish reasons, usage counts (integers, a null as 0), failure and KV transfer."""

from gateway.engine_events import USAGE_COUNTS, delta_of, final_of
from gateway.openai_response import Delta
from gateway.token_text import Vocabulary

NONE = Vocabulary(None)


def test_a_delta_without_logprobs_reads_as_one_delta_with_none():
    event = {"type": "delta", "index": 1, "text": " w", "token_ids": [7, 8], "tool_calls": [{"index": 0}]}
    assert delta_of(event, vocabulary=NONE) == Delta(index=1, text=" w", logprobs=[], finish_reason=None, tokens=2,
                                                     tool_calls=[{"index": 0}])  # fmt: skip
    empty = delta_of({"type": "delta", "logprobs": [], "prompt_logprobs": None}, vocabulary=NONE)
    assert empty == Delta(index=0, text="", logprobs=[], finish_reason=None, tokens=0, tool_calls=[])


def test_a_final_event_reads_its_counts_as_integers_and_a_null_as_zero():
    usage = {"prompt_tokens": 3, "cached_tokens": None, "completion_tokens": 2.0, "sampling_steps": True,
             "kv_transfer": {"blocks_pulled": 4}, "other": 9}  # fmt: skip
    event = {"type": "final", "finish_reason": "length", "error": None, "usage": usage,
             "choices": [{"index": 0, "finish_reason": "length"}, {"index": 1}]}  # fmt: skip
    read = final_of(event)
    assert dict(zip(USAGE_COUNTS, read.usage, strict=True)) == {"prompt_tokens": 3, "cached_tokens": 0, "completion_tokens": 2, "spec_proposed_tokens": 0,
                          "spec_accepted_tokens": 0, "sampling_steps": 1}  # fmt: skip
    assert all(type(count) is int for count in read.usage)
    assert read.finishes == [(0, "length"), (1, "stop")]
    assert (read.error, read.error_type, read.kv_transfer) == (None, None, {"blocks_pulled": 4})
    plain = final_of({"type": "final", "usage": {"prompt_tokens": 5, "completion_tokens": 1}})
    assert dict(zip(USAGE_COUNTS, plain.usage, strict=True)) == {"prompt_tokens": 5, "cached_tokens": 0, "completion_tokens": 1, "spec_proposed_tokens": 0,
                           "spec_accepted_tokens": 0, "sampling_steps": 0}  # fmt: skip


def test_a_failed_final_event_carries_its_error_and_kind():
    event = {"type": "final", "finish_reason": "error", "error_type": "adapter_unavailable", "usage": {}}
    read = final_of(event)
    assert (read.error, read.error_type, read.kv_transfer) == ("the engine failed", "adapter_unavailable", None)
    named = final_of(event | {"error": "out of memory", "error_type": ""})
    assert (named.error, named.error_type) == ("out of memory", None)
