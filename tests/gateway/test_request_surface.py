"""The rest of the request surface OpenAI clients send, through the official `openai` client: token-array and batched
prompts, echo with logprobs, max_tokens past the context, and the models' creation times."""

import openai
import pytest

from tests.gateway.conftest import BASE_MODEL, client

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

CONTEXT = 256  # the stack's tiny model (tests/engine/conftest.py)
GREEDY = {"max_tokens": 4, "temperature": 0}


def test_a_token_array_prompt_answers_as_its_text_does(stack):
    api = client(stack, stack.keys["main"])
    by_text = api.completions.create(model="support", prompt="w10 w11 w12", **GREEDY)
    by_tokens = api.completions.create(model="support", prompt=[10, 11, 12], **GREEDY)
    assert by_tokens.choices[0].text == by_text.choices[0].text
    assert by_tokens.usage.prompt_tokens == 3 == by_text.usage.prompt_tokens


@pytest.mark.parametrize("prompts", [[[10, 11], [20, 21, 22]], ["w10 w11", "w20 w21 w22"]], ids=["tokens", "texts"])
def test_a_batch_of_prompts_answers_each_with_n_choices(stack, prompts):
    api = client(stack, stack.keys["main"])
    alone = [api.completions.create(model="support", prompt=prompt, **GREEDY) for prompt in prompts]
    batch = api.completions.create(model="support", prompt=prompts, n=2, **GREEDY)
    assert [choice.index for choice in batch.choices] == [0, 1, 2, 3]
    assert [choice.text for choice in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    streamed = list(api.completions.create(model="support", prompt=prompts, n=2, stream=True, **GREEDY))
    texts = ["".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i) for i in range(4)]
    assert texts == [choice.text for choice in batch.choices]


@pytest.mark.parametrize(("prompt", "message"), [
    ([10, 10**6], "vocabulary"),
    ([[10, 11], [-1]], "'prompt' must be"),
    ([[10, 11], "w10"], "'prompt' must be"),
    ([[10]] * 33, "at most 32 prompts"),
], ids=["out-of-vocab", "negative", "mixed", "too-many"])
def test_bad_token_prompts_are_a_400_naming_the_prompt(stack, prompt, message):
    api = client(stack, stack.keys["main"])
    with pytest.raises(openai.BadRequestError) as raised:
        api.completions.create(model="support", prompt=prompt, max_tokens=2)
    assert raised.value.param == "prompt" and message in raised.value.message


def test_a_batch_asking_for_too_many_completions_is_a_400_naming_n(stack):
    with pytest.raises(openai.BadRequestError) as raised:
        client(stack, stack.keys["main"]).completions.create(model="support", prompt=[[10]] * 8, n=9, max_tokens=2)
    assert raised.value.param == "n" and "72 completions" in raised.value.message


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_with_logprobs_scores_the_prompt_too(stack, stream):
    api = client(stack, stack.keys["main"])
    answer = api.completions.create(model="support", prompt="w10 w11 w12", echo=True, logprobs=2, stream=stream,
                                    max_tokens=3, temperature=0)  # fmt: skip
    if stream:
        chunks = [chunk.choices[0] for chunk in answer if chunk.choices]
        text = "".join(c.text for c in chunks)
        tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
        logprobs = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
        tops = [t for c in chunks if c.logprobs for t in c.logprobs.top_logprobs]
    else:
        choice = answer.choices[0]
        text, tokens = choice.text, choice.logprobs.tokens
        logprobs, tops = choice.logprobs.token_logprobs, choice.logprobs.top_logprobs
    assert text.startswith("w10 w11 w12")
    assert tokens[:3] == ["w10", "w11", "w12"] and len(tokens) == 3 + 3
    assert logprobs[0] is None and tops[0] is None  # nothing precedes the first prompt token, as OpenAI's
    assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs[1:])
    assert all(len(top) == 2 for top in tops[1:])


def test_echo_of_a_token_prompt_is_its_text(stack):
    api = client(stack, stack.keys["main"])
    answer = api.completions.create(model="support", prompt=[10, 11], echo=True, **GREEDY)
    assert answer.choices[0].text.startswith("w10 w11")


def test_max_tokens_past_the_context_is_refused_as_openai_refuses_it(stack):
    api = client(stack, stack.keys["main"])
    messages = [{"role": "user", "content": "w10 w11"}]
    with pytest.raises(openai.BadRequestError) as raised:
        api.chat.completions.create(model="support", messages=messages, max_tokens=CONTEXT - 3)
    error = raised.value
    assert (error.code, error.param) == ("context_length_exceeded", "messages")
    assert f"maximum context length is {CONTEXT} tokens" in error.message
    assert "in the completion" in error.message and str(CONTEXT - 3) in error.message
    with pytest.raises(openai.BadRequestError) as raised:
        api.completions.create(model="support", prompt=[10, 11], max_tokens=10**4)
    assert (raised.value.code, raised.value.param) == ("context_length_exceeded", "max_tokens")
    assert "10000" in raised.value.message and str(CONTEXT) in raised.value.message
    with pytest.raises(openai.BadRequestError) as raised:
        api.completions.create(model="support", prompt=[10] * 100, max_tokens=CONTEXT - 99)
    assert (raised.value.code, raised.value.param) == ("context_length_exceeded", "prompt")
    fits = api.completions.create(model="support", prompt=[10] * 100, max_tokens=CONTEXT - 100, temperature=0)
    assert fits.choices[0].finish_reason in ("stop", "length")
    unasked = api.chat.completions.create(model="support", messages=messages)  # the plan's default: capped
    assert unasked.choices[0].finish_reason in ("stop", "length")


def test_models_carry_their_creation_times(stack):
    from registry.models import Adapter, BaseModel

    api = client(stack, stack.keys["main"])
    models = {model.id: model.created for model in api.models.list()}
    base = BaseModel.objects.get(name=BASE_MODEL)
    adapter = Adapter.objects.get(tenant_id=stack.ids["main"], name="support", deleted_at__isnull=True)
    assert models[BASE_MODEL] == int(base.created_at.timestamp()) > 0
    assert models["support"] == int(adapter.created_at.timestamp()) > 0
    pinned = api.models.retrieve("support@1")
    assert pinned.created == int(adapter.versions.get(number=1).created_at.timestamp())
