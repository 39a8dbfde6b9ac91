"""The engine server's prompt surface: batches of prompts, prompt log-probabilities, and refusing a request whose
prompt plus max_tokens is past the context. Checked against transformers (the outside oracle)."""

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.engine.pictures import data_url, picture
from tests.engine.test_server import CONTEXT, adapter_refs, generate, model_dir, server, stream_lines  # noqa: F401

PROMPTS = [[5, 17, 33, 90, 4], [120, 8, 61], [7, 7, 200, 13, 42, 99]]


@pytest.fixture(scope="module")
def hf_model(model_dir):  # noqa: F811
    return LlamaForCausalLM.from_pretrained(model_dir).eval()


def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompt_logprobs(model, prompt: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[i - 1, prompt[i]].item() for i in range(1, len(prompt))]


def test_a_batch_of_token_prompts_answers_each_as_transformers_does(server, hf_model):  # noqa: F811
    result = generate(server, prompt_token_ids=PROMPTS,
                      sampling={"temperature": 0, "max_tokens": 5, "ignore_eos": True, "n": 2})
    choices = result["choices"]
    assert [c["index"] for c in choices] == list(range(2 * len(PROMPTS)))
    for p, prompt in enumerate(PROMPTS):
        expected = greedy(hf_model, prompt, 5)
        assert choices[2 * p]["token_ids"] == expected and choices[2 * p + 1]["token_ids"] == expected
    usage = result["usage"]
    assert usage["prompt_tokens"] == sum(map(len, PROMPTS))
    assert usage["completion_tokens"] == 5 * 2 * len(PROMPTS)


def test_a_streamed_batch_of_text_prompts_streams_each_by_index(server):  # noqa: F811
    body = {"prompt": ["the cat", "a dog sees"], "stream": True,
            "sampling": {"temperature": 0, "max_tokens": 4, "ignore_eos": True}}
    with server.stream("POST", "/v1/generate", json=body) as response:
        events = list(stream_lines(response))
    final = events[-1]
    for choice in final["choices"]:
        deltas = [e for e in events[:-1] if e["index"] == choice["index"]]
        assert [t for e in deltas for t in e["token_ids"]] == choice["token_ids"]
    alone = [generate(server, prompt=text, sampling=body["sampling"])["token_ids"] for text in body["prompt"]]
    assert [c["token_ids"] for c in final["choices"]] == alone


def test_a_batch_with_one_bad_prompt_is_refused_whole(server):  # noqa: F811
    steps_before = server.get("/v1/state").json()["steps"]
    response = server.post("/v1/generate", json={"prompt_token_ids": [[5, 6], [10**6]], "stream": False})
    assert response.status_code == 400 and "vocabulary size" in response.json()["error"]["message"]
    assert server.get("/v1/state").json()["steps"] == steps_before
    assert server.get("/v1/state").json()["running_requests"] == []


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_prompt_logprobs_match_transformers(server, hf_model, stream):  # noqa: F811
    prompt = PROMPTS[0]
    body = {"prompt_token_ids": prompt, "stream": stream,
            "sampling": {"temperature": 0, "max_tokens": 2, "ignore_eos": True, "prompt_logprobs": 2}}
    if stream:
        with server.stream("POST", "/v1/generate", json=body) as response:
            events = list(stream_lines(response))
        with_prompt = [e for e in events if "prompt_logprobs" in e and e["type"] == "delta"]
        assert len(with_prompt) == 1  # the first delta only
        entries = with_prompt[0]["prompt_logprobs"]
    else:
        entries = generate(server, **body)["choices"][0]["prompt_logprobs"]
    assert [e["token_id"] for e in entries] == prompt
    assert entries[0]["logprob"] is None
    assert [e["logprob"] for e in entries[1:]] == pytest.approx(prompt_logprobs(hf_model, prompt), abs=1e-3)
    assert all(len(e["top"]) == 2 for e in entries[1:])


def test_max_tokens_past_the_context_is_refused_when_asked(server):  # noqa: F811
    prompt = [5] * 100
    body = {"prompt_token_ids": prompt, "stream": False, "sampling": {"max_tokens": CONTEXT - 50}}
    capped = server.post("/v1/generate", content=json.dumps({**body, "sampling": {"max_tokens": 1}}))
    assert capped.status_code == 200
    response = server.post("/v1/generate", json={**body, "context_overflow": "refuse"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    assert f"requested {100 + CONTEXT - 50} tokens (100 in the prompt, {CONTEXT - 50} in the completion)" \
        in error["message"]
    bad = server.post("/v1/generate", json={**body, "context_overflow": "maybe"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "context_overflow"


def test_every_completion_of_a_batch_carries_its_own_prompts_logprobs(server, hf_model):  # noqa: F811
    result = generate(server, prompt_token_ids=PROMPTS[:2],
                      sampling={"temperature": 0, "max_tokens": 2, "ignore_eos": True, "n": 2, "prompt_logprobs": 0})
    for choice in result["choices"]:
        prompt = PROMPTS[choice["index"] // 2]
        entries = choice["prompt_logprobs"]
        assert [e["token_id"] for e in entries] == prompt
        assert [e["logprob"] for e in entries[1:]] == pytest.approx(prompt_logprobs(hf_model, prompt), abs=1e-3)


def test_an_image_for_a_text_only_model_is_a_400_naming_its_part(server):  # noqa: F811
    content = [{"type": "text", "text": "the cat"}, {"type": "image_url", "image_url": {"url": data_url(picture(30, 20, 1))}}]
    response = server.post("/v1/generate", json={"stream": False, "messages": [{"role": "user", "content": content}],
                                                 "sampling": {"max_tokens": 2}})  # fmt: skip
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages.[0].content.[1]" and "takes no images" in error["message"]
    content[1]["image_url"]["detail"] = "ultra"
    response = server.post("/v1/generate", json={"stream": False, "messages": [{"role": "user", "content": content}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages.[0].content.[1]"
