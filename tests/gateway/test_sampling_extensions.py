"""vLLM's sampling extensions that load tools send (guidellm, `vllm bench serve`, aiperf, genai-perf), through the
official `openai` client (`extra_body`, as those tools send them) and as raw SSE bytes: accepted as vLLM accepts
them, refused by name when malformed, and never past max_tokens or the hold."""

import json

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from tests.gateway.conftest import BASE_MODEL, client

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

CHAT = [{"role": "user", "content": "w20 w21 w22"}]
PROMPT = [30, 31, 32, 33]  # token ids of the tiny model's word-level vocabulary ("w30 w31 w32 w33")


def _token_ids(choice) -> list[int]:
    """A completion's tokens, from its text: the word-level vocabulary's "w37" is token 37."""
    return [int(word.removeprefix("w")) for word in choice.text.split()]


@pytest.fixture(scope="module")
def hf_model(stack):
    return AutoModelForCausalLM.from_pretrained(stack.model_dir, dtype=torch.float32).eval()


def _hf_greedy(model, prompt: list[int], max_new_tokens: int, **options) -> list[int]:
    """transformers' generate, greedy, with eos never ending it (ignore_eos)."""
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
                              **options)  # fmt: skip
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt):].tolist()


def test_ignore_eos_and_min_tokens_as_guidellm_sends_them(stack):
    api = client(stack, stack.keys["main"])
    for ask in ({"ignore_eos": True}, {"ignore_eos": True, "min_tokens": 6}, {"min_tokens": 6}):
        chat = api.chat.completions.create(model="support", messages=CHAT, max_tokens=6, temperature=0,
                                           extra_body=ask)  # fmt: skip
        assert chat.usage.completion_tokens == 6 and chat.choices[0].finish_reason == "length", ask
        text = api.completions.create(model=BASE_MODEL, prompt="w30 w31", max_tokens=6, extra_body=ask)
        assert text.usage.completion_tokens == 6 and text.choices[0].finish_reason == "length", ask


def test_the_extensions_that_change_tokens_match_transformers(stack, hf_model):
    api = client(stack, stack.keys["main"])
    for options in ({"repetition_penalty": 1.8}, {"repetition_penalty": 0.6}):
        got = api.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True, **options})  # fmt: skip
        assert _token_ids(got.choices[0]) == _hf_greedy(hf_model, PROMPT, 8, **options), options
    plain = _hf_greedy(hf_model, PROMPT, 8)
    for options in ({"top_k": 1}, {"min_p": 1.0}):  # filters that keep the likeliest token alone
        got = api.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=8, temperature=1.5, seed=5,
                                     extra_body={"ignore_eos": True, **options})  # fmt: skip
        assert _token_ids(got.choices[0]) == plain, options
    stop_at = next(i for i in range(2, 8) if plain[i] not in plain[:i])
    got = api.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                 extra_body={"stop_token_ids": [plain[stop_at]]})  # fmt: skip
    assert _token_ids(got.choices[0]) == plain[: stop_at + 1] and got.choices[0].finish_reason == "stop"


def test_sampled_extensions_are_accepted_on_both_endpoints(stack):
    api = client(stack, stack.keys["main"])
    extra = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "stop_token_ids": [], "ignore_eos": False,
             "min_tokens": 0}  # fmt: skip
    chat = api.chat.completions.create(model="support", messages=CHAT, max_tokens=4, seed=3, extra_body=extra)
    assert chat.choices[0].message.content
    text = api.completions.create(model=BASE_MODEL, prompt="w30", max_tokens=4, seed=3, extra_body=extra)
    assert text.choices[0].text
    nulls = dict.fromkeys(extra)  # null is each one's default, as vLLM reads it
    assert api.completions.create(model=BASE_MODEL, prompt="w30", max_tokens=2, extra_body=nulls).choices


def _raw_stream(stack, path: str, body: dict) -> bytes:
    with httpx.stream("POST", f"{stack.gateways[0]}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {stack.keys['main']}"}) as response:  # fmt: skip
        assert response.status_code == 200, response.read()
        return response.read()


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_continuous_usage_is_in_every_chunk_byte_for_byte(stack, kind):
    """aiperf's stream_options: every chunk carries its running usage, as vLLM writes it; the usage chunk the
    request's whole usage."""
    if kind == "chat":
        path, body = "/chat/completions", {"model": "support", "messages": CHAT}
    else:
        path, body = "/completions", {"model": BASE_MODEL, "prompt": "w30 w31"}
    body |= {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
             "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    raw = _raw_stream(stack, path, body)
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    chunks = [json.loads(event.removeprefix(b"data: ")) for event in events[:-2]]
    first, usage_chunk = chunks[0], chunks[-1]
    prompt = usage_chunk["usage"]["prompt_tokens"]
    assert prompt > 0 and usage_chunk["usage"]["completion_tokens"] == 4 and usage_chunk["choices"] == []
    opening = {"id": first["id"], "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
               "created": first["created"], "model": body["model"], "system_fingerprint": None}  # fmt: skip
    texts = [c["choices"][0]["delta"]["content"] if kind == "chat" else c["choices"][0]["text"] for c in chunks[:4]]
    expected = []
    for made, text in enumerate(texts, start=1):
        content = {"text": text} if kind == "completion" else \
            {"delta": ({"role": "assistant"} if made == 1 else {}) | {"content": text}}  # fmt: skip
        expected.append(opening | {
            "choices": [{"index": 0, **content, "logprobs": None, "finish_reason": None}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made},
        })  # fmt: skip
    finish = {"text": ""} if kind == "completion" else {"delta": {"content": ""}}
    expected.append(opening | {
        "choices": [{"index": 0, **finish, "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": 4, "total_tokens": prompt + 4},
    })  # fmt: skip
    expected.append(opening | {"choices": [], "usage": usage_chunk["usage"]})
    assert raw == b"".join(b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n" for c in expected) + \
        b"data: [DONE]\n\n"  # fmt: skip
    whole = _raw_whole(stack, path, {k: v for k, v in body.items() if k not in ("stream", "stream_options")})
    assert "".join(texts) == whole


def _raw_whole(stack, path: str, body: dict) -> str:
    answer = httpx.post(f"{stack.gateways[0]}{path}", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {stack.keys['main']}"}).json()  # fmt: skip
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_continuous_usage_through_the_openai_client(stack):
    chunks = list(client(stack, stack.keys["main"]).chat.completions.create(
        model="support", messages=CHAT, max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    ))  # fmt: skip
    assert all(chunk.usage is not None for chunk in chunks)
    counts = [chunk.usage.completion_tokens for chunk in chunks if chunk.choices]
    assert counts == [1, 2, 3, 4, 5, 5]  # a chunk per token, then the finish
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    # without continuous_usage_stats (or without include_usage, as vLLM), the chunks' usage stays null
    for options in ({"include_usage": True, "continuous_usage_stats": False}, {"continuous_usage_stats": True}):
        chunks = list(client(stack, stack.keys["main"]).chat.completions.create(
            model="support", messages=CHAT, max_tokens=3, temperature=0, stream=True, stream_options=options))
        assert all(chunk.usage is None for chunk in chunks if chunk.choices), options


@pytest.mark.parametrize(("extra", "param", "message"), [
    ({"ignore_eos": "yes"}, "ignore_eos", "boolean"),
    ({"min_tokens": -1}, "min_tokens", "between 0"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "less than or equal to 'max_tokens' (4)"),
    ({"min_tokens": 17}, "min_tokens", "the plan's default"),  # no max_tokens: the plan's 16
    ({"top_k": -2}, "top_k", "between -1"),
    ({"top_k": 1.5}, "top_k", "an integer"),
    ({"min_p": 1.5}, "min_p", "between 0 and 1"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "token ids"),
    ({"stop_token_ids": "7"}, "stop_token_ids", "token ids"),
    ({"stop_token_ids": [10**6], "min_tokens": 2}, "stop_token_ids", "below"),  # the engine's: past its vocabulary
    ({"stream": True, "stream_options": {"include_usage": True, "usage_every_chunk": True}}, "stream_options",
     "'include_usage', 'include_obfuscation' and 'continuous_usage_stats'"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": 1}}, "stream_options.continuous_usage_stats",
     "boolean"),
    ({"beam_width": 2}, "beam_width", "Unrecognized request argument supplied: beam_width"),
], ids=["ignore-eos-type", "min-tokens-negative", "min-tokens-past-max", "min-tokens-past-default", "top-k-range",
        "top-k-type", "min-p-range", "repetition-penalty-zero", "stop-token-negative", "stop-tokens-type",
        "stop-token-past-vocabulary", "stream-options-key", "stream-options-type", "unknown-field"])  # fmt: skip
def test_malformed_extensions_are_a_400_naming_the_field(stack, extra, param, message):
    body = {"model": BASE_MODEL, "messages": CHAT} | extra
    response = httpx.post(f"{stack.gateways[0]}/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {stack.keys['main']}"})  # fmt: skip
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert message in error["message"], error


def test_an_ignore_eos_request_is_held_for_max_tokens_and_served_within_them(stack):
    api = client(stack, stack.keys["main"])
    completion = api.chat.completions.create(model=BASE_MODEL, messages=CHAT, max_tokens=7,
                                             extra_body={"ignore_eos": True, "min_tokens": 7})  # fmt: skip
    assert completion.usage.completion_tokens == 7
    with pytest.raises(openai.BadRequestError) as raised:  # more than max_tokens is never asked of the engine
        api.chat.completions.create(model=BASE_MODEL, messages=CHAT, max_tokens=7, extra_body={"min_tokens": 8})
    assert raised.value.param == "min_tokens"
    tight = client(stack, stack.keys["keyed-tpm"])  # its 120 tokens a minute hold no prompt with 150 more
    with pytest.raises(openai.RateLimitError):
        tight.chat.completions.create(model=BASE_MODEL, messages=CHAT, max_tokens=150,
                                      extra_body={"ignore_eos": True, "min_tokens": 1})  # fmt: skip


LOAD_TOOL_BODIES = {  # the bodies these tools build (their streaming request functions), fields in their order
    "guidellm-chat": ("/chat/completions", {
        "model": BASE_MODEL, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": 5, "stop": None, "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "w20 w21 w22"}]}]}),
    "guidellm-completions": ("/completions", {
        "model": BASE_MODEL, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": 5, "stop": None, "ignore_eos": True, "prompt": "w20 w21 w22"}),
    "vllm-bench-serve-chat": ("/chat/completions", {
        "model": BASE_MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "w20 w21 w22"}]}],
        "max_completion_tokens": 5, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}),
    "vllm-bench-serve-completions": ("/completions", {
        "model": BASE_MODEL, "prompt": "w20 w21 w22", "repetition_penalty": 1.0, "max_tokens": 5, "logprobs": None,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}),
}  # fmt: skip


@pytest.mark.parametrize("tool", LOAD_TOOL_BODIES)
def test_load_tools_bodies_stream_to_max_tokens(stack, tool):
    path, body = LOAD_TOOL_BODIES[tool]
    events = _raw_stream(stack, path, body).split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    chunks = [json.loads(event.removeprefix(b"data: ")) for event in events[:-2]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    continuous = body["stream_options"].get("continuous_usage_stats", False)
    assert all((chunk["usage"] is not None) == continuous for chunk in chunks[:-1])
