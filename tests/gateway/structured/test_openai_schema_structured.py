"""The API docs describe tool calls and structured outputs as the gateway answers them: real answers on the demo
model (whose chat template knows tools), whole and streamed, match the published schemas, and a tool-calling
loop's requests are ones the published request schema accepts."""

import json

import pytest

from tests.gateway.structured.conftest import BASE_MODEL, client
from tests.gateway.structured.test_openai_structured import CLOCK, SENTENCE, WEATHER
from tests.gateway.v1_schema import check_answer, component, sse_events

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

CHAT_PATH = "/v1/chat/completions"
MOOD = {"type": "object", "properties": {"mood": {"enum": ["calm", "loud"]}}, "required": ["mood"],
        "additionalProperties": False}  # fmt: skip


def test_tool_calls_whole_and_their_answer_are_as_documented(demo_stack):
    api = client(demo_stack)
    request = {"model": BASE_MODEL, "messages": [{"role": "user", "content": "what is the weather in oslo"}],
               "tools": [WEATHER, CLOCK], "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0,
               "max_tokens": 128}  # fmt: skip
    assert component("ChatCompletionRequest").is_valid(request)
    raw = api.chat.completions.with_raw_response.create(**request)
    body = raw.http_response.json()
    check_answer("post", CHAT_PATH, 200, body, headers=raw.headers)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    answer = {**request, "max_tokens": 8, "tool_choice": "auto", "messages": [
        *request["messages"], choice["message"],
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"sky": "clear"})}]}  # fmt: skip
    del answer["parallel_tool_calls"]
    assert component("ChatCompletionRequest").is_valid(answer), list(component("ChatCompletionRequest").iter_errors(answer))
    final = api.chat.completions.with_raw_response.create(**answer)
    check_answer("post", CHAT_PATH, 200, final.http_response.json(), headers=final.headers)


def test_streamed_tool_calls_are_as_documented(demo_stack):
    request = {"model": "shout", "messages": [{"role": "user", "content": "the time please"}], "tools": [WEATHER, CLOCK],
               "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "parallel_tool_calls": False, "temperature": 0,
               "max_tokens": 128, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    assert component("ChatCompletionRequest").is_valid(request)
    with client(demo_stack).chat.completions.with_streaming_response.create(**request) as raw:
        chunks = sse_events(raw.iter_lines())
    for chunk in chunks:
        check_answer("post", CHAT_PATH, 200, chunk, content_type="text/event-stream")
    parts = [part for chunk in chunks for choice in chunk["choices"] for part in choice["delta"].get("tool_calls", [])]
    assert parts[0]["id"] and parts[0]["function"]["name"] == "get_time"  # the call's first part: id and name
    arguments = "".join(part["function"].get("arguments", "") for part in parts)
    assert set(json.loads(arguments)) == {"zone"}
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"


def test_json_schema_answers_whole_and_streamed_are_as_documented(demo_stack):
    api = client(demo_stack)
    request = {"model": BASE_MODEL, "messages": [{"role": "user", "content": SENTENCE}], "temperature": 0,
               "max_tokens": 48, "response_format": {"type": "json_schema", "json_schema": {
                   "name": "mood", "schema": MOOD, "strict": True}}}  # fmt: skip
    assert component("ChatCompletionRequest").is_valid(request)
    raw = api.chat.completions.with_raw_response.create(**request)
    body = raw.http_response.json()
    check_answer("post", CHAT_PATH, 200, body, headers=raw.headers)
    assert set(json.loads(body["choices"][0]["message"]["content"])) == {"mood"}
    with api.chat.completions.with_streaming_response.create(**request, stream=True) as streamed:
        chunks = sse_events(streamed.iter_lines())
    for chunk in chunks:
        check_answer("post", CHAT_PATH, 200, chunk, content_type="text/event-stream")
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])
    assert text == body["choices"][0]["message"]["content"]
