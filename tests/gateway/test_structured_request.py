"""Tool messages, tools and response_format as the gateway reads them, and tool calls as it answers them (whole and
as stream chunks): the shapes, without processes (tests/gateway/structured runs them end to end)."""

import json

import pytest

from gateway.errors import ApiError
from gateway.openai_request import parse_chat
from gateway.openai_response import Delta, ResponseBuilder

TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}


def chat(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | extra


def test_a_tool_loop_history_reaches_the_engine_as_chat_templates_expect():
    request = parse_chat(chat(messages=[
        {"role": "user", "content": "time?"},
        {"role": "assistant", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "12:00"}]},
    ], tools=[TOOL], tool_choice="auto", parallel_tool_calls=False))  # fmt: skip
    assert request.messages[1] == {"role": "assistant", "content": None, "tool_calls": [CALL]}
    assert request.messages[2] == {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}
    assert request.structure == {"tools": [TOOL], "tool_choice": "auto", "parallel_tool_calls": False}
    assert request.prompt_bytes() >= len(json.dumps([TOOL]))  # the tools are part of the prompt's hold


@pytest.mark.parametrize("messages, param", [
    ([{"role": "tool", "content": "12:00"}], "messages.[0].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages.[0].tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": 1}}}]}],
     "messages.[0].tool_calls.[0]"),
    ([{"role": "function", "name": "f", "content": "x"}], "messages.[0]"),
], ids=["tool-without-call-id", "user-with-calls", "arguments-not-text", "deprecated-function-role"])  # fmt: skip
def test_malformed_tool_messages_are_named(messages, param):
    with pytest.raises(ApiError) as raised:
        parse_chat(chat(messages=messages))
    assert raised.value.status == 400 and raised.value.param == param


@pytest.mark.parametrize("extra, param", [
    ({"parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [TOOL] * 129}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"functions": [{"name": "f"}]}, "functions"),
], ids=["parallel-without-tools", "duplicate-name", "not-a-function", "too-many-tools", "schema-not-object",
        "deprecated-functions"])  # fmt: skip
def test_more_bad_structure_is_named(extra, param):
    with pytest.raises(ApiError) as raised:
        parse_chat(chat(**extra))
    assert raised.value.param == param


def test_tool_calls_answer_as_openai_does():
    builder = ResponseBuilder(kind="chat", request_id="r", model="m", n=1, logprobs=False)
    call = {"index": 0, "id": "call_9", "name": "get_time", "arguments": '{"zone":"utc"}'}
    delta = Delta(index=0, text="", logprobs=[], finish_reason=None, tokens=20, tool_calls=[call])
    frames = [json.loads(f.removeprefix(b"data: ")) for f in builder.chunk(delta, with_usage_field=False).split(b"\n\n")
              if f]  # fmt: skip
    assert [f["choices"][0]["delta"] for f in frames] == [
        {"role": "assistant", "content": ""},
        {"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                         "function": {"name": "get_time", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"zone":"utc"}'}}]},
    ]  # fmt: skip
    builder.apply(delta)
    builder.apply(Delta(index=0, text="", logprobs=[], finish_reason="tool_calls"))
    choice = builder.body()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {"id": "call_9", "type": "function", "function": {"name": "get_time", "arguments": '{"zone":"utc"}'}}]


def test_argument_fragments_add_up_in_the_answer_and_stream_as_fragments():
    builder = ResponseBuilder(kind="chat", request_id="r", model="m", n=1, logprobs=False)
    parts = [{"index": 0, "id": "call_7", "name": "get_time", "arguments": ""}, {"index": 0, "arguments": '{"zo'},
             {"index": 0, "arguments": 'ne":"cet"}'}]  # fmt: skip
    chunks = []
    for part in parts:
        delta = Delta(index=0, text="", logprobs=[], finish_reason=None, tokens=3, tool_calls=[part])
        chunks += [json.loads(f.removeprefix(b"data: ")) for f in builder.chunk(delta, with_usage_field=False)
                   .split(b"\n\n") if f]  # fmt: skip
        builder.apply(delta)
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert calls[0]["function"] == {"name": "get_time", "arguments": ""} and calls[0]["id"] == "call_7"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"zone":"cet"}'
    assert builder.body()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"zone":"cet"}'
