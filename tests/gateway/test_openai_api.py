"""The inference API through the official `openai` client: models, chat and completions, streaming, errors."""

import httpx
import openai
import pytest

from tests.gateway.conftest import BASE_MODEL, client

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

CHAT = [{"role": "user", "content": "w20 w21 w22"}]


def test_models_lists_base_models_and_own_adapters_only(stack):
    listing = client(stack, stack.keys["main"]).models.with_raw_response.list()
    assert listing.headers["x-ratelimit-reset-requests"].endswith("s")
    ids = {model.id for model in listing.parse()}
    assert {BASE_MODEL, "support", "shouty"} <= ids
    assert "secret" not in ids  # the rival tenant's adapter
    rival_ids = {model.id for model in client(stack, stack.keys["rival"]).models.list()}
    assert "secret" in rival_ids and "support" not in rival_ids


def test_model_retrieve_pinned_version_and_unknown(stack):
    api = client(stack, stack.keys["main"])
    assert api.models.retrieve("support@1").id == "support@1"
    with pytest.raises(openai.NotFoundError) as raised:
        api.models.retrieve("secret")  # exists, but for another tenant
    assert raised.value.code == "model_not_found"


def test_chat_completion_through_an_adapter(stack):
    raw = client(stack, stack.keys["main"]).chat.completions.with_raw_response.create(
        model="support", messages=CHAT, max_tokens=6, temperature=0
    )
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert completion.model == "support"
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0
    headers = raw.headers
    assert headers["x-request-id"] and completion.id.endswith(headers["x-request-id"])
    for name in ("limit-requests", "remaining-requests", "reset-requests", "limit-tokens", "remaining-tokens", "reset-tokens"):
        assert f"x-ratelimit-{name}" in headers
    assert int(headers["x-ratelimit-remaining-requests"]) < int(headers["x-ratelimit-limit-requests"])


def test_adapters_change_the_answer(stack):
    api = client(stack, stack.keys["main"])
    answers = {
        model: api.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0).choices[0].message.content
        for model in (BASE_MODEL, "support", "shouty")
    }
    assert len(set(answers.values())) == 3, answers


def test_streamed_chat_matches_the_whole_answer_and_ends_with_usage(stack):
    api = client(stack, stack.keys["main"])
    whole = api.chat.completions.create(model="support", messages=CHAT, max_tokens=8, temperature=0)
    chunks = list(
        api.chat.completions.create(
            model="support", messages=CHAT, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert len({chunk.id for chunk in chunks}) == 1
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [chunk for chunk in chunks if chunk.choices]
    assert with_choices[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(chunk.choices[0].finish_reason is None for chunk in with_choices[:-1])
    assert "".join(chunk.choices[0].delta.content or "" for chunk in with_choices) == whole.choices[0].message.content
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_streamed_and_whole_usage_are_openais_shape_alike_without_speculation(stack):
    """This engine does not speculate: the usage is OpenAI's fields alone, the same streamed and whole."""
    api = client(stack, stack.keys["main"])
    request = {"model": BASE_MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0}
    whole = api.chat.completions.create(**request).usage
    streamed = list(api.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    last = streamed[-1].usage
    for usage in (whole, last):
        assert set(usage.model_dump(exclude_unset=True)) == {
            "prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details", "completion_tokens_details"
        }  # fmt: skip
    assert last.model_dump() == whole.model_dump()


def test_usage_carries_the_engines_speculative_counts_where_it_speculated():
    """The three counts the engine's final event carries (docs/speculative.md) reach the client's usage when the
    engine proposed tokens for the request; the relay reads them with the rest of the usage (engine_events)."""
    from gateway import engine_events
    from gateway.openai_response import Usage

    assert set(engine_events.USAGE_COUNTS) >= {"spec_proposed_tokens", "spec_accepted_tokens", "sampling_steps"}
    body = Usage(prompt_tokens=5, completion_tokens=9, spec_proposed_tokens=8, spec_accepted_tokens=6,
                 sampling_steps=3).body()  # fmt: skip
    assert body["total_tokens"] == 14
    assert (body["spec_proposed_tokens"], body["spec_accepted_tokens"], body["sampling_steps"]) == (8, 6, 3)


def test_stream_without_usage_option_has_no_usage_chunk(stack):
    chunks = list(
        client(stack, stack.keys["main"]).chat.completions.create(
            model=BASE_MODEL, messages=CHAT, max_tokens=4, stream=True
        )
    )
    assert chunks and all(chunk.choices for chunk in chunks)


def test_completions_whole_and_streamed(stack):
    api = client(stack, stack.keys["main"])
    whole = api.completions.create(model="shouty", prompt="w30 w31", max_tokens=5, temperature=0, seed=7)
    assert whole.object == "text_completion" and whole.choices[0].text
    streamed = list(api.completions.create(model="shouty", prompt="w30 w31", max_tokens=5, temperature=0, stream=True))
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == whole.choices[0].text


def test_completions_echo_the_prompt_whole_and_streamed(stack):
    api = client(stack, stack.keys["main"])
    request = {"model": "shouty", "prompt": "w30 w31", "max_tokens": 4, "temperature": 0, "n": 2}
    plain = api.completions.create(**request)
    echoed = api.completions.create(**request, echo=True)
    assert [c.text for c in echoed.choices] == ["w30 w31" + c.text for c in plain.choices]
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    streamed = list(api.completions.create(**request, echo=True, stream=True))
    for choice in echoed.choices:
        texts = [c.choices[0].text for c in streamed if c.choices and c.choices[0].index == choice.index]
        assert texts[0].startswith("w30 w31") and "".join(texts) == choice.text


def test_top_p_zero_keeps_only_the_likeliest_token(stack):
    """OpenAI accepts top_p from 0 to 1; the nucleus of p = 0 is the single likeliest token."""
    api = client(stack, stack.keys["main"])
    request = {"model": "support", "messages": CHAT, "max_tokens": 8}
    greedy = api.chat.completions.create(**request, temperature=0).choices[0].message.content
    for seed in (1, 2, 3):
        sampled = api.chat.completions.create(**request, temperature=2, top_p=0, seed=seed)
        assert sampled.choices[0].message.content == greedy


def test_sampling_parameters_are_accepted(stack):
    completion = client(stack, stack.keys["main"]).chat.completions.create(
        model="support@1", messages=CHAT, max_completion_tokens=4, temperature=0.7, top_p=0.9, n=2, stop=["w9"],
        seed=3, presence_penalty=0.5, frequency_penalty=0.5, logprobs=True, top_logprobs=2, user="end-user-1",
    )  # fmt: skip
    assert [choice.index for choice in completion.choices] == [0, 1]
    for choice in completion.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)


def test_bad_key_is_an_authentication_error(stack):
    with pytest.raises(openai.AuthenticationError) as raised:
        client(stack, "nope.not-a-key").chat.completions.create(model=BASE_MODEL, messages=CHAT)
    assert raised.value.code == "invalid_api_key"
    assert raised.value.response.headers["x-request-id"]


def test_unknown_model_is_not_found(stack):
    with pytest.raises(openai.NotFoundError) as raised:
        client(stack, stack.keys["main"]).chat.completions.create(model="no-such-model", messages=CHAT)
    assert raised.value.code == "model_not_found" and raised.value.param == "model"
    assert raised.value.response.headers["x-ratelimit-remaining-requests"]


def test_key_without_inference_scope_or_model_is_forbidden(stack):
    with pytest.raises(openai.PermissionDeniedError):
        client(stack, stack.keys["main-admin"]).chat.completions.create(model=BASE_MODEL, messages=CHAT)
    limited = client(stack, stack.keys["main-limited"])
    assert limited.chat.completions.create(model="support", messages=CHAT, max_tokens=2).choices
    with pytest.raises(openai.PermissionDeniedError) as raised:
        limited.chat.completions.create(model="shouty", messages=CHAT, max_tokens=2)
    assert raised.value.code == "model_not_allowed"


@pytest.mark.parametrize(
    "extra, param",
    [
        # this model's chat template has no tool-calling convention, its word-level vocabulary cannot write JSON
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
         "messages.[0].content.[0]"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"temperature": 3}, "temperature"),
        ({"messages": [{"role": "user", "content": "w1"}, {"role": "bot", "content": "w2"}]}, "messages.[1].role"),
        ({"frobnicate": True}, "frobnicate"),
    ],
    ids=["tools", "image", "json-mode", "temperature-range", "wrong-role", "unknown-parameter"],
)
def test_unsupported_or_invalid_parameters_are_a_clear_400(stack, extra, param):
    body = {"model": BASE_MODEL, "messages": CHAT} | extra
    response = httpx.post(
        f"{stack.gateways[0]}/chat/completions", json=body, headers={"Authorization": f"Bearer {stack.keys['main']}"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert response.headers["x-request-id"] and response.headers["x-ratelimit-limit-tokens"]


def test_exhausted_budget_is_a_rate_limit_error(stack):
    with pytest.raises(openai.RateLimitError) as raised:
        client(stack, stack.keys["broke"]).chat.completions.create(model=BASE_MODEL, messages=CHAT, max_tokens=2)
    assert raised.value.code == "insufficient_quota"
    headers = raised.value.response.headers
    assert int(headers["retry-after"]) > 0 and headers["x-ratelimit-limit-requests"]


def test_a_prompt_past_the_context_is_a_400_with_the_engines_reason(stack):
    prompt = "w10 " * 1100  # also past QUILT_TOKENIZE_ABOVE_BYTES: the hold is sized by the engine's count
    with pytest.raises(openai.BadRequestError) as raised:
        client(stack, stack.keys["main"]).completions.create(model=BASE_MODEL, prompt=prompt, max_tokens=2)
    assert "1100 tokens" in raised.value.message
    assert (raised.value.code, raised.value.param) == ("context_length_exceeded", "prompt")  # OpenAI's


def test_a_chat_past_the_context_is_a_400_naming_the_messages(stack):
    messages = [{"role": "user", "content": "w10 " * 1100}]
    with pytest.raises(openai.BadRequestError) as raised:
        client(stack, stack.keys["main"]).chat.completions.create(model=BASE_MODEL, messages=messages, max_tokens=2)
    assert raised.value.status_code == 400 and "tokens" in raised.value.message
    assert (raised.value.code, raised.value.param) == ("context_length_exceeded", "messages")
