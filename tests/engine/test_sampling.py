"""Sampling features of the engine, on the tiny Llama (oracle: transformers where one applies)."""

import pytest

from engine import LLM, SamplingParams
from tests.engine.conftest import Oracle, random_prompts


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(checkpoints["llama"], block_size=4, num_kv_blocks=256)


@pytest.fixture(scope="module")
def oracle(checkpoints):
    return Oracle(checkpoints["llama"], {})


def test_seed_gives_same_tokens_whatever_the_batch(llm):
    prompt = random_prompts(30, [7])[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].token_ids
    others = SamplingParams(temperature=1.3, max_tokens=20, ignore_eos=True)
    batch = llm.generate(random_prompts(31, [3, 15]) + [prompt], [others, others, seeded])
    assert batch[2].token_ids == alone
    other_seed = llm.generate([prompt], SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=12,
                                                        ignore_eos=True))[0]
    assert other_seed.token_ids != alone


def test_filters_that_keep_one_token_are_greedy(llm, oracle):
    prompt = random_prompts(32, [9])[0]
    expected = oracle.greedy(prompt, None, 6)
    for params in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        out = llm.generate([prompt], SamplingParams(temperature=1.5, max_tokens=6, ignore_eos=True, **params))[0]
        assert out.token_ids == expected, params


def test_penalties_match_their_definition(llm, oracle):
    prompts = random_prompts(33, [4, 8])
    params = SamplingParams(temperature=0.0, max_tokens=10, frequency_penalty=0.7, presence_penalty=1.1,
                            ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        assert out.token_ids == oracle.greedy(prompt, None, 10, frequency_penalty=0.7, presence_penalty=1.1)


def test_n_completions_share_the_prompt_blocks(checkpoints):
    llm = LLM(checkpoints["llama"], block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
    prompt = random_prompts(34, [18])[0]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))[0]
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.choices}) == 3
    assert [c.usage.cached_tokens for c in out.choices] == [0, 16, 16]
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert plain.usage.cached_tokens == 0  # prefix caching is off for everything else
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_stop_token_ids_and_min_tokens(llm, oracle):
    prompt = random_prompts(35, [6])[0]
    greedy = oracle.greedy(prompt, None, 8)
    stop_at = next(i for i in range(2, 8) if greedy[i] not in greedy[:i])
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[greedy[stop_at]]))[0]
    assert out.token_ids == greedy[: stop_at + 1] and out.finish_reason == "stop"
    banned = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3, stop_token_ids=[greedy[0]])
    out = llm.generate([prompt], banned)[0]
    assert out.token_ids[0] != greedy[0] and len(out.token_ids) >= 3


def test_stop_strings_are_not_emitted(llm):
    prompt = random_prompts(36, [5])[0]
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    words = full.text.split()
    stop = words[3]
    assert stop not in " ".join(words[:3])
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert out.token_ids == full.token_ids[:4]


def test_string_prompts_and_chat_template(llm, oracle):
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "w10 w11 w12"}])
    assert text == "<s>user : w10 w11 w12 </s> assistant : "
    ids = llm.tokenizer.encode(text)
    out = llm.generate([text], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert out.prompt_token_ids == ids
    assert out.token_ids == oracle.greedy(ids, None, 5)
    assert out.text == " " + llm.tokenizer.decode(out.token_ids)


def test_streamed_text_only_grows_and_holds_back_a_possible_stop_string(llm):
    prompt = random_prompts(37, [5])[0]
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].text
    fourth = full.split()[3]
    stop = fourth[-2:] + " #"  # the fourth word ends like its start, but it never completes
    engine = llm.engine
    engine.add_request("stream", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=[stop]))
    texts = []
    while engine.has_unfinished():
        texts += [out.text for out in engine.step()]
    assert texts[-1] == full and len(texts) == 8
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:], strict=False))
    through_fourth = full[: full.index(fourth) + len(fourth)]
    assert texts[3] == through_fourth[:-2]  # held back while it might be the start of the stop string


def test_an_output_keeps_the_logprobs_of_its_step(llm):
    """The server turns outputs into events after later steps ran: each keeps the log-probabilities it was made
    with, not the sequence's growing list (its delta's last entry would be a later token's)."""
    engine = llm.engine
    engine.add_request("logprobs", random_prompts(38, [5])[0], SamplingParams(temperature=0.0, max_tokens=4,
                                                                              ignore_eos=True, logprobs=1))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [len(out.logprobs) for out in outputs] == [1, 2, 3, 4]
    assert [out.logprobs[-1].token_id for out in outputs] == outputs[-1].token_ids
