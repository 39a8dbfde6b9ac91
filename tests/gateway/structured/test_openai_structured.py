"""Structured outputs, tool calls and logit_bias through the official `openai` client, on the demo model and its
adapters (the `extract` adapter answers in JSON): what clients see, what they are refused, what they are billed."""

import json
import time

import jsonschema
import openai
import pytest
from pydantic import BaseModel
from tokenizers import Tokenizer

from engine.demo import corpus
from tests.gateway.structured.conftest import BASE_MODEL, client

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

SENTENCE = corpus.held_out_sentences(4)[3]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "oslo", "lima"]},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False},
}}  # fmt: skip
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False},
}}  # fmt: skip


class Sentence(BaseModel):
    subject: str
    verb: str
    object: str


def test_parse_returns_the_pydantic_object_through_the_json_adapter(demo_stack):
    completion = client(demo_stack).chat.completions.parse(
        model="extract", messages=[{"role": "user", "content": SENTENCE}], response_format=Sentence,
        temperature=0, max_tokens=64,
    )  # fmt: skip
    message = completion.choices[0].message
    assert isinstance(message.parsed, Sentence), message.content
    assert SENTENCE.startswith(message.parsed.subject) and message.parsed.object in SENTENCE
    assert completion.choices[0].finish_reason == "stop"


def test_json_modes_hold_on_a_model_that_never_saw_json(demo_stack):
    api = client(demo_stack)
    schema = {"type": "object", "properties": {"mood": {"enum": ["calm", "loud"]}, "words": {
        "type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}}, "required": ["mood", "words"],
              "additionalProperties": False}
    for model in (BASE_MODEL, "shout"):
        reply = api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": SENTENCE}], temperature=0, max_tokens=160,
            response_format={"type": "json_schema", "json_schema": {"name": "mood", "schema": schema, "strict": True}},
        )  # fmt: skip
        assert reply.choices[0].finish_reason == "stop", (model, reply.choices[0].message.content)
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    anything = api.chat.completions.create(model="extract", messages=[{"role": "user", "content": SENTENCE}],
                                           response_format={"type": "json_object"}, max_tokens=120, temperature=0)
    assert anything.choices[0].finish_reason == "stop", anything.choices[0].message.content
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_a_constrained_answer_cut_by_max_tokens_ends_with_length(demo_stack):
    reply = client(demo_stack).chat.completions.create(
        model="extract", messages=[{"role": "user", "content": SENTENCE}], temperature=0, max_tokens=6,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": Sentence.model_json_schema()}},
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6
    assert reply.choices[0].message.content.startswith('{"')
    with pytest.raises(openai.LengthFinishReasonError):  # the SDK's parse refuses a partial answer, as on OpenAI
        client(demo_stack).chat.completions.parse(model="extract", messages=[{"role": "user", "content": SENTENCE}],
                                                 response_format=Sentence, temperature=0, max_tokens=6)


def _loop_messages(call_id: str, name: str, arguments: str) -> list[dict]:
    return [
        {"role": "user", "content": "what is the weather in oslo"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"sky": "clear", "degrees": 4})},
    ]  # fmt: skip


def test_a_tool_calling_loop(demo_stack):
    api = client(demo_stack)
    first = api.chat.completions.create(
        model=BASE_MODEL, messages=[{"role": "user", "content": "what is the weather in oslo"}], tools=[WEATHER, CLOCK],
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=128,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    schema = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    messages = [{"role": "user", "content": "what is the weather in oslo"},
                choice.message.model_dump(exclude_none=True),  # the assistant's message sent back as is (README)
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "clear", "degrees": 4})}]
    final = api.chat.completions.create(model=BASE_MODEL, messages=messages, tools=[WEATHER, CLOCK], temperature=0,
                                        max_tokens=24)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_a_tool_calling_loop_streamed(demo_stack):
    api = client(demo_stack)
    calls: dict[int, dict] = {}
    finish, fragments = None, 0
    stream = api.chat.completions.create(
        model="shout", messages=[{"role": "user", "content": "the time please"}], tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False, stream=True,
        temperature=0, max_tokens=128,
    )  # fmt: skip
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            call["name"] += part.function.name or "" if part.function else ""
            call["arguments"] += part.function.arguments or "" if part.function else ""
            fragments += bool(part.function and part.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert fragments > 1  # the arguments streamed as the model wrote them
    assert calls[0]["name"] == "get_time" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), CLOCK["function"]["parameters"])
    # the SDK's own stream helper assembles the same call
    with api.chat.completions.stream(
        model="shout", messages=[{"role": "user", "content": "the time please"}], tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False, temperature=0,
        max_tokens=128,
    ) as helper:  # fmt: skip
        done = helper.get_final_completion()
    assert done.choices[0].message.tool_calls[0].function.arguments == calls[0]["arguments"]
    text = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in api.chat.completions.create(
            model="shout", messages=_loop_messages(calls[0]["id"], "get_time", calls[0]["arguments"]),
            tools=[WEATHER, CLOCK], stream=True, temperature=0, max_tokens=24)
        if chunk.choices
    )  # fmt: skip
    assert text


def test_logit_bias_steers_the_next_token(demo_stack):
    tokenizer = Tokenizer.from_file(str(demo_stack.model_dir / "tokenizer.json"))
    token = tokenizer.token_to_id("moon")
    api = client(demo_stack)
    reply = api.chat.completions.create(model=BASE_MODEL, messages=[{"role": "user", "content": SENTENCE}],
                                        temperature=0, max_tokens=1, logit_bias={str(token): 100})
    assert reply.choices[0].message.content == "moon"
    spellings = [tokenizer.token_to_id(spelling) for spelling in ("moon", "\u0120moon")]  # alone, and after a space
    banned = api.chat.completions.create(model=BASE_MODEL, messages=[{"role": "user", "content": "the moon"}],
                                         temperature=0, max_tokens=4,
                                         logit_bias={str(t): -100 for t in spellings if t is not None})  # fmt: skip
    assert "moon" not in banned.choices[0].message.content
    completion = api.completions.create(model="shout", prompt="the cat sees", max_tokens=1, temperature=0,
                                        logit_bias={str(token): 100})
    assert completion.choices[0].text == "moon"


def test_constrained_requests_are_metered_like_any_other(demo_stack):
    from metering.models import UsageEvent
    from tests.gateway.conftest import wait_until

    raw = client(demo_stack).chat.completions.with_raw_response.create(
        model="extract", messages=[{"role": "user", "content": SENTENCE}], temperature=0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": Sentence.model_json_schema()}},
    )  # fmt: skip
    reply = raw.parse()
    row = wait_until(lambda: UsageEvent.objects.filter(request_id=raw.headers["x-request-id"]).first(), timeout=60,
                     what="the usage event")  # fmt: skip
    assert (row.prompt_tokens, row.completion_tokens) == (reply.usage.prompt_tokens, reply.usage.completion_tokens)
    assert row.gpu_ms > 0 and row.model == "extract" and row.finish_reason == "stop"


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema", "invalid schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(?<=a)b"}}}}, "response_format.json_schema.schema", "unsupported feature"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 200} for i in range(400)}}}}},
     "response_format.json_schema.schema", "too large"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
     "response_format.json_schema.name", "schema without a name"),
    ({"response_format": {"type": "yaml"}}, "response_format", "unknown format"),
    ({"tools": []}, "tools", "empty tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name",
     "tool without a name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "unknown named function"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice without tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "wrong"}}}}}], "tool_choice": "required"}, "tools", "invalid tool parameters"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias key"),
    ({"logit_bias": {"5": 500}}, "logit_bias", "logit_bias value"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias", "logit_bias past the vocabulary"),
    ({"logit_bias": [5]}, "logit_bias", "logit_bias shape"),
]  # fmt: skip


@pytest.mark.parametrize("extra, param, case", BAD, ids=[case for _, _, case in BAD])
def test_bad_input_is_a_400_naming_the_parameter(demo_stack, extra, param, case):
    api = client(demo_stack)
    with pytest.raises(openai.BadRequestError) as raised:
        api.chat.completions.create(model="extract", messages=[{"role": "user", "content": SENTENCE}], max_tokens=4,
                                    **extra)
    assert raised.value.status_code == 400 and raised.value.param == param, (case, raised.value.body)
    assert raised.value.body["type"] == "invalid_request_error"
    started = time.monotonic()  # nothing else was harmed: the engine answers at once
    assert api.chat.completions.create(model="extract", messages=[{"role": "user", "content": SENTENCE}],
                                       max_tokens=2).choices[0].message.content is not None
    assert time.monotonic() - started < 30
