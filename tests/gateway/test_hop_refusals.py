"""Which engine refusals of a disaggregated hop are the client's answer and which are the hop's failure (then the
request is served whole): the refusal bodies are the engine's own, from its request parser (engine.server.protocol),
of this version and of the previous one, which names an unknown kv_transfer field by its last part only."""

import json

import pytest

from engine.server.protocol import BadRequest, parse_generate
from gateway.disaggregation import refuses_the_request
from gateway.engine_client import EngineRejected


def refusal(body: dict) -> EngineRejected:
    with pytest.raises(BadRequest) as raised:
        parse_generate(json.dumps(body).encode())
    error = raised.value
    answer = {"error": {"type": "invalid_request_error", "message": str(error), "param": error.param, "code": error.code}}
    return EngineRejected.of(400, json.dumps(answer).encode())


def test_a_refusal_of_the_hop_is_no_refusal_of_the_request():
    prompt = {"prompt_token_ids": [1, 2, 3], "stream": False}
    hop = refusal(prompt | {"kv_transfer": {"mode": "prefill", "ttl": 3}})  # a field this engine does not know
    assert hop.param == "kv_transfer.ttl"
    assert not refuses_the_request(hop)
    assert not refuses_the_request(refusal(prompt | {"kv_transfer": {"mode": "decode"}}))
    # the previous engine's words for a lease field it did not know: a bare name, the path in the message only
    older = EngineRejected(400, "unknown field 'layout_version' in kv_transfer.lease; expected one of [...]",
                           param="layout_version")  # fmt: skip
    assert not refuses_the_request(older)


def test_a_refusal_of_the_request_itself_is_the_clients_answer():
    prompt = {"prompt_token_ids": [1, 2, 3], "stream": False}
    assert refuses_the_request(refusal(prompt | {"sampling": {"temperature": -1}}))
    assert refuses_the_request(refusal(prompt | {"sampling": {"beam_width": 2}}))
    assert refuses_the_request(refusal({"prompt": "", "stream": False}))
