"""vLLM's sampling extensions (what load tools send) against transformers + PEFT, through an adapter, on the
reference ops and on the Triton launchers under the interpreter.

Greedy, token for token against `generate()`: ignore_eos (generate with no end token), min_tokens (min_new_tokens),
stop_token_ids (generate's end tokens), repetition_penalty. Sampled: top_k and min_p make the distribution that
transformers' warpers make of the same logits, and every token the engine samples with them is one those warpers
keep. The model here ends a sequence with a token its greedy answer makes a few steps in, so that ending matters."""

import json
import shutil

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper

import kernels
from engine import SamplingParams
from engine.sampler import Sampler
from tests.engine.conftest import Oracle, build_adapter, random_prompts
from tests.engine.test_families import ALL, make_llm

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model(checkpoints, tmp_path_factory):
    """The tiny Llama with an adapter, its end tokens </s> and the token its greedy answer (through the adapter)
    first makes at step 3 or later: (model dir, adapters, oracle, prompt, that answer, the end token)."""
    root = tmp_path_factory.mktemp("eos-model")
    base = root / "model"
    shutil.copytree(checkpoints["llama"], base)
    adapters = {"a": build_adapter(base, root / "a", seed=70, r=4, targets=ALL)}
    oracle = Oracle(base, adapters)
    prompt = random_prompts(71, [7])[0]
    greedy = oracle.greedy(prompt, "a", MAX_TOKENS)
    eos = next(token for i, token in enumerate(greedy) if i >= 3 and token not in greedy[:i] and token != 2)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps(config | {"eos_token_id": [2, eos]}))
    return base, adapters, oracle, prompt, greedy, eos


@pytest.fixture(params=["reference", "triton"])
def ops(request):
    if request.param == "triton":
        request.getfixturevalue("triton_launchers")
    return request.param


def _generate(oracle: Oracle, prompt: list[int], *, eos: list[int] | None, **options) -> list[int]:
    """transformers + PEFT's generate(), greedy, through adapter "a"; `eos`: its end tokens (None: it never ends
    before max_new_tokens, what ignore_eos asks)."""
    oracle.model.set_adapter("a")
    config = GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=eos, pad_token_id=0, **options)
    with torch.no_grad():
        out = oracle.model.generate(input_ids=torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt):].tolist()


def test_greedy_extensions_match_generate(model, ops):
    base, adapters, oracle, prompt, greedy, eos = model
    ends = [2, eos]
    stop_token = next(t for i, t in enumerate(greedy) if i >= 1 and t not in greedy[:i] and t not in ends)
    at_eos = greedy.index(eos)
    cases = {  # name: (engine's sampling, generate's end tokens, generate's options)
        "eos-ends": ({}, ends, {}),
        "ignore-eos": ({"ignore_eos": True}, None, {}),
        "min-tokens": ({"min_tokens": at_eos + 2}, ends, {"min_new_tokens": at_eos + 2}),
        "stop-token-ids": ({"stop_token_ids": [stop_token], "ignore_eos": True}, [stop_token], {}),
        "repetition-penalty-up": ({"repetition_penalty": 1.6, "ignore_eos": True}, None, {"repetition_penalty": 1.6}),
        "repetition-penalty-down": ({"repetition_penalty": 0.5, "ignore_eos": True}, None, {"repetition_penalty": 0.5}),
    }  # fmt: skip
    llm = make_llm(base, adapters)
    assert kernels.backend_for(llm.engine.memory.layers[0]) == ("triton" if ops == "triton" else "reference")
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **engine) for engine, _, _ in cases.values()]
    outputs = llm.generate([prompt] * len(cases), params, adapters=["a"] * len(cases))
    got = {name: out.token_ids for name, out in zip(cases, outputs, strict=True)}
    for name, (_, generate_ends, options) in cases.items():
        assert got[name] == _generate(oracle, prompt, eos=generate_ends, **options), name
    # each changes the answer it is meant to change
    assert got["eos-ends"] == greedy[: at_eos + 1] and got["ignore-eos"] == greedy
    assert len(got["min-tokens"]) > at_eos + 1 and got["min-tokens"][: at_eos + 2].count(eos) == 0
    assert got["stop-token-ids"][-1] == stop_token and len(got["stop-token-ids"]) < MAX_TOKENS
    assert got["repetition-penalty-down"] != greedy


WARPED = [
    {"temperature": 0.7, "top_k": 4},
    {"temperature": 1.3, "min_p": 0.2},
    {"temperature": 1.0, "top_k": 12, "min_p": 0.05},
]


def _warpers(params: dict) -> LogitsProcessorList:
    """transformers' warpers, in generate()'s order: temperature, top-k, min-p."""
    warpers = [TemperatureLogitsWarper(params["temperature"])]
    if params.get("top_k"):
        warpers.append(TopKLogitsWarper(params["top_k"]))
    if params.get("min_p"):
        warpers.append(MinPLogitsWarper(params["min_p"]))
    return LogitsProcessorList(warpers)


@pytest.mark.parametrize("params", WARPED, ids=["top-k", "min-p", "top-k-and-min-p"])
def test_top_k_and_min_p_draw_from_transformers_distribution(model, params):
    _, _, oracle, prompt, _, _ = model
    logits = oracle.logits(prompt, "a")  # [len(prompt), vocab]: each position's next-token logits
    expected = _warpers(params)(torch.tensor([prompt]), logits.clone()).softmax(dim=-1)
    got = Sampler.distribution(logits, [SamplingParams(**params)] * len(prompt))
    got = got / got.sum(dim=-1, keepdim=True)
    assert torch.allclose(got, expected, atol=1e-6)
    assert ((expected > 0).sum(dim=-1) < logits.shape[1]).all()  # each one drops tokens


@pytest.mark.parametrize("params", WARPED[:2], ids=["top-k", "min-p"])
def test_sampled_tokens_are_ones_transformers_keeps(model, ops, params):
    base, adapters, oracle, prompt, _, _ = model
    llm = make_llm(base, adapters)
    sampling = SamplingParams(n=3, seed=72, max_tokens=6, ignore_eos=True, **params)
    choices = llm.generate([prompt], sampling, adapters=["a"])[0].choices
    warpers = _warpers(params)
    for choice in choices:
        sequence = prompt + choice.token_ids
        logits = oracle.logits(sequence[:-1], "a")[len(prompt) - 1:]  # [6, vocab]: the rows each token was drawn from
        kept = warpers(torch.tensor([sequence]), logits.clone()) > -float("inf")
        assert all(kept[i, token] for i, token in enumerate(choice.token_ids)), choice.token_ids
    plain = llm.generate([prompt], SamplingParams(n=3, seed=72, max_tokens=6, ignore_eos=True,
                                                  temperature=params["temperature"]), adapters=["a"])[0].choices
    assert [c.token_ids for c in plain] != [c.token_ids for c in choices]  # the filter changed what was drawn
