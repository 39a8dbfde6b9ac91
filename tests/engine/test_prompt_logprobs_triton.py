"""Prompt log-probabilities (what `echo` with `logprobs` serves) through adapters, on the GPU path without a GPU:
every op on its Triton launcher under Triton's interpreter, against transformers + PEFT. A prompt chunked over
steps (max_num_batched_tokens) is scored whole, and each completion of n gets its own."""

import pytest
import torch

import kernels
from engine import SamplingParams
from tests.engine.conftest import Oracle, build_adapter, random_prompts
from tests.engine.test_families import ALL, make_llm


def test_prompt_logprobs_through_adapters_on_the_triton_launchers_match_peft(checkpoints, tmp_path, triton_launchers):
    base = checkpoints["llama"]
    adapters = {"all": build_adapter(base, tmp_path / "all", seed=90, r=4, targets=ALL)}
    llm = make_llm(base, adapters, max_num_batched_tokens=8)
    assert kernels.backend_for(llm.engine.memory.layers[0]) == "triton"
    names = ["all", None]
    prompts = random_prompts(91, [11, 5])  # the first is chunked over two steps
    sampling = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=1, n=2)
    outputs = llm.generate(prompts, sampling, adapters=names)
    oracle = Oracle(base, adapters)
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        rows = torch.log_softmax(oracle.logits(prompt, name), dim=-1)
        expected = [float(rows[i - 1, prompt[i]]) for i in range(1, len(prompt))]
        for choice in out.choices:
            assert choice.prompt_logprobs[0] is None
            got = [entry.logprob for entry in choice.prompt_logprobs[1:]]
            assert got == pytest.approx(expected, abs=1e-4), f"adapter {name}, completion {choice.index}"
