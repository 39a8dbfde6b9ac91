"""The generate stream's events: written by the engine, read by the gateway with the same structs."""

import msgspec
import pytest

from engine.contract import VERSION, Delta, Final, StreamEvent
from engine.contract.events import Choice, FinalUsage, KVPull, Logprob

decode = msgspec.json.Decoder(StreamEvent).decode


def test_a_delta_is_written_with_only_the_fields_it_has():
    plain = Delta(request_id="r", index=0, text="hi", token_ids=[5])
    assert msgspec.json.encode(plain) == b'{"type":"delta","request_id":"r","index":0,"text":"hi","token_ids":[5]}'
    rich = Delta(request_id="r", index=1, text="", token_ids=[7], prompt_tokens=3,
                 logprobs=[Logprob(token_id=7, logprob=-0.5, top={7: -0.5, 9: -1.5})])  # fmt: skip
    assert decode(msgspec.json.encode(rich)) == rich
    assert b'"top":{"7":-0.5,"9":-1.5}' in msgspec.json.encode(rich)


def test_a_final_event_round_trips_with_its_version():
    final = Final(request_id="r", finish_reason="stop", text="hi", token_ids=[5],
                  choices=[Choice(index=0, text="hi", token_ids=[5], finish_reason="stop", error=None,
                                  error_type=None)],
                  usage=FinalUsage(prompt_tokens=3, completion_tokens=1, e2e_ms=2.0,
                                   kv_transfer=KVPull(lease_id="ab" * 8, blocks_pulled=2)))  # fmt: skip
    line = msgspec.json.encode(final)
    assert line.startswith(b'{"type":"final"') and b'"v":%d' % VERSION in line
    assert decode(line) == final


def test_a_stream_of_another_version_ends_in_its_version():
    line = msgspec.json.encode(Final(request_id="r", finish_reason="stop"))
    with pytest.raises(msgspec.ValidationError, match=f"generate stream version {VERSION + 1} is not"):
        decode(line.replace(b'"v":%d' % VERSION, b'"v":%d' % (VERSION + 1)))


def test_an_event_of_an_unknown_type_is_named():
    with pytest.raises(msgspec.ValidationError, match="Invalid value 'usage' - at `\\$.type`"):
        decode(b'{"type":"usage","request_id":"r"}')
