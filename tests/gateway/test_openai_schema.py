"""The API docs describe /v1 as it answers: real answers of the gateway (whole, streamed, with logprobs, refusals)
match the schemas the docs publish, and the documented request schema refuses what the gateway refuses."""

import json

import httpx
import openai
import pytest

from tests.gateway.conftest import BASE_MODEL, client
from tests.gateway.v1_schema import check_answer, component, operation, sse_events

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
CHAT = [{"role": "user", "content": "w20 w21 w22"}]


def test_a_chat_completion_with_logprobs_is_as_documented(stack):
    raw = client(stack, stack.keys["main"]).chat.completions.with_raw_response.create(
        model="support", messages=CHAT, max_tokens=4, temperature=0, n=2, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    body = raw.http_response.json()
    check_answer("post", CHAT_PATH, 200, body, headers=raw.headers)
    assert body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]


def test_each_chunk_of_a_streamed_chat_is_as_documented(stack):
    api = client(stack, stack.keys["main"])
    with api.chat.completions.with_streaming_response.create(
        model=BASE_MODEL, messages=CHAT, max_tokens=5, stream=True, stream_options={"include_usage": True},
        logprobs=True,
    ) as raw:  # fmt: skip
        assert raw.headers["content-type"].startswith("text/event-stream")
        chunks = sse_events(raw.iter_lines())
    assert len(chunks) >= 3 and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    for chunk in chunks:
        check_answer("post", CHAT_PATH, 200, chunk, content_type="text/event-stream")


def test_chunks_with_continuous_usage_are_as_documented(stack):
    options = {"include_usage": True, "continuous_usage_stats": True}
    api = client(stack, stack.keys["main"])
    with api.chat.completions.with_streaming_response.create(
        model=BASE_MODEL, messages=CHAT, max_tokens=3, stream=True, stream_options=options, extra_body={"ignore_eos": True},
    ) as raw:  # fmt: skip
        chunks = sse_events(raw.iter_lines())
    with api.completions.with_streaming_response.create(model=BASE_MODEL, prompt=[5, 6], max_tokens=3, stream=True,
                                                        stream_options=options) as streamed:  # fmt: skip
        completion_chunks = sse_events(streamed.iter_lines())
    assert all(chunk["usage"] for chunk in chunks + completion_chunks)
    for chunk in chunks:
        check_answer("post", CHAT_PATH, 200, chunk, content_type="text/event-stream")
    for chunk in completion_chunks:
        check_answer("post", COMPLETIONS_PATH, 200, chunk, content_type="text/event-stream")


def test_a_completion_whole_and_streamed_is_as_documented(stack):
    api = client(stack, stack.keys["main"])
    raw = api.completions.with_raw_response.create(model=BASE_MODEL, prompt=["w1 w2", "w3"], max_tokens=3, echo=True,
                                                   logprobs=2)  # fmt: skip
    body = raw.http_response.json()
    check_answer("post", COMPLETIONS_PATH, 200, body, headers=raw.headers)
    assert body["choices"][0]["logprobs"]["token_logprobs"][0] is None  # the echoed prompt's first token
    with api.completions.with_streaming_response.create(model=BASE_MODEL, prompt=[5, 6, 7], max_tokens=3, stream=True,
                                                        stream_options={"include_usage": True}) as streamed:  # fmt: skip
        for chunk in sse_events(streamed.iter_lines()):
            check_answer("post", COMPLETIONS_PATH, 200, chunk, content_type="text/event-stream")


def test_models_are_as_documented(stack):
    api = client(stack, stack.keys["main"])
    listing = api.models.with_raw_response.list()
    check_answer("get", "/v1/models", 200, listing.http_response.json(), headers=listing.headers)
    pinned = api.models.with_raw_response.retrieve("support@1")
    check_answer("get", "/v1/models/{name}", 200, pinned.http_response.json(), headers=pinned.headers)


def test_files_and_fine_tuning_answers_are_as_documented(stack):
    api = client(stack, stack.keys["main"])
    lines = [{"messages": [{"role": "user", "content": f"w{i}"}, {"role": "assistant", "content": "w1"}]}
             for i in range(12)]  # fmt: skip
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    created = api.files.with_raw_response.create(file=("schema.jsonl", content), purpose="fine-tune")
    check_answer("post", "/v1/files", 200, created.http_response.json())
    file_id = created.parse().id
    check_answer("get", "/v1/files", 200, api.files.with_raw_response.list(limit=2).http_response.json())
    check_answer("get", "/v1/files/{file_id}", 200, api.files.with_raw_response.retrieve(file_id).http_response.json())
    check_answer("get", "/v1/fine_tuning/jobs", 200,
                 api.fine_tuning.jobs.with_raw_response.list().http_response.json())  # fmt: skip
    for call, path, status in (
        (lambda: api.fine_tuning.jobs.create(model=BASE_MODEL, training_file=file_id,
                                             hyperparameters={"n_epochs": 99}), "/v1/fine_tuning/jobs", 400),
        (lambda: api.fine_tuning.jobs.retrieve("ftjob-none"), "/v1/fine_tuning/jobs/{job_id}", 404),
    ):  # fmt: skip
        error = _refusal(call)
        assert error.status_code == status
        check_answer("post" if status == 400 else "get", path, status, error.response.json())
    check_answer("delete", "/v1/files/{file_id}", 200, api.files.with_raw_response.delete(file_id).http_response.json())


def _refusal(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as raised:
        call()
    return raised.value


@pytest.mark.parametrize(("key", "request_", "status", "code"), [
    ("main", {"temperature": 7}, 400, None),
    ("nobody", {}, 401, "invalid_api_key"),
    ("broke-reader", {}, 403, "insufficient_scope"),
    ("main", {"model": "no-such-model"}, 404, "model_not_found"),
    ("broke", {}, 429, "insufficient_quota"),
], ids=["bad-parameter", "bad-key", "no-scope", "unknown-model", "budget"])  # fmt: skip
def test_refusals_are_documented_errors_with_their_headers(stack, key, request_, status, code):
    api = client(stack, stack.keys.get(key, "qk_not_a_key"))
    error = _refusal(lambda: api.chat.completions.create(**{"model": BASE_MODEL, "messages": CHAT, "max_tokens": 2,
                                                             **request_}))  # fmt: skip
    assert error.status_code == status and error.code == code
    check_answer("post", CHAT_PATH, status, error.response.json(), headers=error.response.headers)
    if status == 429:
        assert int(error.response.headers["retry-after"]) > 0
        assert {"x-ratelimit-limit-requests", "x-ratelimit-remaining-tokens"} <= set(error.response.headers)


def test_media_type_and_method_refusals_are_documented(stack):
    headers = {"Authorization": f"Bearer {stack.keys['main']}"}
    form = httpx.post(f"{stack.gateways[0]}/chat/completions", content=b"a=b", headers=headers | {
        "Content-Type": "application/x-www-form-urlencoded"})  # fmt: skip
    check_answer("post", CHAT_PATH, form.status_code, form.json(), headers=form.headers)
    assert form.status_code == 415
    wrong_method = httpx.get(f"{stack.gateways[0]}/chat/completions", headers=headers)
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    check_answer("post", CHAT_PATH, 405, wrong_method.json(), headers=wrong_method.headers)


TEXT = {"role": "user", "content": "w1"}
CHAT_BODIES = {
    "minimal": {"messages": [TEXT]},
    "text-parts-and-developer": {"messages": [{"role": "developer", "content": [{"type": "text", "text": "w2"}]},
                                              TEXT]},
    "sampling": {"messages": [TEXT], "temperature": 0, "top_p": 0, "n": 2, "seed": 7, "stop": ["w9", "w8"],
                 "presence_penalty": 1.5, "user": "u-1", "max_completion_tokens": 1, "metadata": {"a": "b"}},
    "logit-bias": {"messages": [TEXT], "logit_bias": {"5": -100, "6": 100}},
    "stream-usage": {"messages": [TEXT], "stream": True, "stream_options": {"include_usage": True}},
    "nulls": {"messages": [TEXT], "stop": None, "tools": None, "response_format": None, "stream": None},
    "text-format": {"messages": [TEXT], "response_format": {"type": "text"}},
    "unknown-field": {"messages": [TEXT], "temperatur": 1},
    "temperature-past-2": {"messages": [TEXT], "temperature": 2.5},
    "n-past-16": {"messages": [TEXT], "n": 17},
    "five-stops": {"messages": [TEXT], "stop": ["a", "b", "c", "d", "e"]},
    "empty-stop": {"messages": [TEXT], "stop": ""},
    "bias-past-100": {"messages": [TEXT], "logit_bias": {"5": 101}},
    "no-messages": {"messages": []},
    "unknown-role": {"messages": [{"role": "robot", "content": "w1"}]},
    "image-part-of-an-assistant": {"messages": [TEXT, {"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}, TEXT]},
    "audio-part": {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
    "no-content": {"messages": [{"role": "user"}]},
    "assistant-null-content": {"messages": [TEXT, {"role": "assistant", "content": None}, TEXT]},
    "assistant-turn": {"messages": [TEXT, {"role": "assistant", "content": "w2", "refusal": None}, TEXT]},
    "tool-call-without-id": {"messages": [TEXT, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}, TEXT]},
    "tool-answer-without-call-id": {"messages": [TEXT, {"role": "tool", "content": "{}"}]},
    "xml-format": {"messages": [TEXT], "response_format": {"type": "xml"}},
    "schema-without-name": {"messages": [TEXT], "response_format": {"type": "json_schema", "json_schema": {}}},
    "bad-tool-name": {"messages": [TEXT], "tools": [{"type": "function", "function": {"name": "no spaces"}}]},
    "odd-tool-choice": {"messages": [TEXT], "tools": [{"type": "function", "function": {"name": "f"}}],
                        "tool_choice": "sometimes"},
    "too-many-top-logprobs": {"messages": [TEXT], "logprobs": True, "top_logprobs": 21},
    "unknown-stream-option": {"messages": [TEXT], "stream": True, "stream_options": {"include_usag": True}},
    "deprecated-functions": {"messages": [TEXT], "functions": [{"name": "f"}]},
    "vllm-extensions": {"messages": [TEXT], "ignore_eos": True, "min_tokens": 1, "top_k": 5, "min_p": 0.1,
                        "repetition_penalty": 1.2, "stop_token_ids": [7], "stream": True,
                        "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    "top-k-off": {"messages": [TEXT], "top_k": -1},
    "top-k-past-minus-1": {"messages": [TEXT], "top_k": -2},
    "min-p-past-1": {"messages": [TEXT], "min_p": 1.5},
    "repetition-penalty-zero": {"messages": [TEXT], "repetition_penalty": 0},
    "negative-stop-token": {"messages": [TEXT], "stop_token_ids": [-1]},
    "min-tokens-negative": {"messages": [TEXT], "min_tokens": -1},
    "ignore-eos-string": {"messages": [TEXT], "ignore_eos": "true"},
    "empty-model": {"model": "", "messages": [TEXT]},
}  # fmt: skip
COMPLETION_BODIES = {
    "text": {"prompt": "w1"},
    "batch": {"prompt": ["w1", "w2"], "echo": True, "logprobs": 2, "best_of": 1},
    "token-ids": {"prompt": [5, 6]},
    "token-id-batch": {"prompt": [[5, 6], [7]]},
    "empty-prompt-list": {"prompt": []},
    "empty-token-list": {"prompt": [[]]},
    "mixed-batch": {"prompt": ["w1", [5]]},
    "batch-past-32": {"prompt": ["w1"] * 33},
    "logprobs-past-5": {"prompt": "w1", "logprobs": 6},
    "suffix": {"prompt": "w1", "suffix": "w2"},
    "negative-token": {"prompt": [-1]},
    "vllm-extensions": {"prompt": "w1", "ignore_eos": True, "top_k": 0, "repetition_penalty": 0.5,
                        "stop_token_ids": []},
}


REQUEST_SCHEMAS = {"chat/completions": "ChatCompletionRequest", "completions": "CompletionRequest"}


@pytest.mark.parametrize(("path", "body"), [
    *[pytest.param("chat/completions", body, id=f"chat-{name}") for name, body in CHAT_BODIES.items()],
    *[pytest.param("completions", body, id=f"completion-{name}") for name, body in COMPLETION_BODIES.items()],
])  # fmt: skip
def test_the_request_schema_refuses_what_the_gateway_refuses(stack, path, body):
    body = {"model": BASE_MODEL, "max_tokens": 1} | body
    documented = operation("post", f"/v1/{path}")["requestBody"]["content"]["application/json"]["schema"]
    assert documented == {"$ref": f"#/components/schemas/{REQUEST_SCHEMAS[path]}"}
    answer = httpx.post(f"{stack.gateways[0]}/{path}", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {stack.keys['main']}"})  # fmt: skip
    assert answer.status_code in (200, 400), answer.text
    errors = [error.message for error in component(REQUEST_SCHEMAS[path]).iter_errors(body)]
    assert (not errors) == (answer.status_code == 200), (answer.text[:300], errors[:2])
