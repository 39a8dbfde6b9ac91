"""What the gateway reads from the engine's generate events (decode_event, the contract's structs): a delta's text,
tokens and tool calls; a final event's finish reasons, usage counts, failure and KV transfer; and a line whose
counts are not integers refused naming the field."""

import msgspec
import pytest

from gateway.engine_events import decode_event, delta_of, final_of
from gateway.openai_response import Delta, Usage
from gateway.token_text import Vocabulary

NONE = Vocabulary(None)


def test_a_delta_without_logprobs_reads_as_one_delta_with_none():
    event = decode_event(b'{"type":"delta","request_id":"r","index":1,"text":" w","token_ids":[7,8],'
                         b'"tool_calls":[{"index":0}]}')  # fmt: skip
    assert delta_of(event, vocabulary=NONE) == Delta(index=1, text=" w", logprobs=[], finish_reason=None, tokens=2,
                                                     tool_calls=[{"index": 0}])  # fmt: skip
    empty = delta_of(decode_event(b'{"type":"delta","request_id":"r","index":0,"text":"","token_ids":[],'
                                  b'"logprobs":[],"prompt_logprobs":null}'), vocabulary=NONE)  # fmt: skip
    assert empty == Delta(index=0, text="", logprobs=[], finish_reason=None, tokens=0, tool_calls=[])


def test_a_final_event_reads_its_counts_finishes_and_kv_transfer():
    line = (b'{"type":"final","request_id":"r","finish_reason":"length","error":null,"choices":['
            b'{"index":0,"text":"","token_ids":[],"finish_reason":"length","error":null,"error_type":null},'
            b'{"index":1,"text":"","token_ids":[],"finish_reason":null,"error":null,"error_type":null}],'
            b'"usage":{"prompt_tokens":3,"completion_tokens":2,"sampling_steps":1,'
            b'"kv_transfer":{"lease_id":"ab","blocks_pulled":4,"recomputed":false}}}')  # fmt: skip
    read = final_of(decode_event(line))
    assert read.usage == Usage(prompt_tokens=3, cached_tokens=0, completion_tokens=2, sampling_steps=1)
    assert read.finishes == [(0, "length"), (1, "stop")]
    assert (read.error, read.error_type, read.kv_transfer.blocks_pulled) == (None, None, 4)


@pytest.mark.parametrize("usage", [b'{"cached_tokens":null}', b'{"completion_tokens":2.5}', b'{"sampling_steps":true}'],
                         ids=["null", "fraction", "bool"])  # fmt: skip
def test_a_count_that_is_not_an_integer_is_refused_naming_it(usage):
    with pytest.raises(msgspec.ValidationError, match="at `\\$.usage."):
        decode_event(b'{"type":"final","request_id":"r","finish_reason":"stop","usage":' + usage + b"}")


def test_a_failed_final_event_carries_its_error_and_kind():
    line = b'{"type":"final","request_id":"r","finish_reason":"error","error_type":"adapter_unavailable"}'
    read = final_of(decode_event(line))
    assert (read.error, read.error_type, read.kv_transfer) == ("the engine failed", "adapter_unavailable", None)
    named = final_of(decode_event(line.replace(b'"adapter_unavailable"', b'""').replace(b"}", b',"error":"oom"}')))
    assert (named.error, named.error_type) == ("oom", None)
