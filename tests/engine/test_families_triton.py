"""The GPU path without a GPU: the whole engine with every op on its Triton launcher, run by Triton's
interpreter on CPU tensors (kernels.interpreter.enable()), for every family, against transformers + PEFT.
Few tokens: the interpreter runs each kernel program as Python."""

import pytest

import kernels
from engine import SamplingParams
from tests.engine.conftest import FAMILIES, Oracle, build_adapter, random_prompts
from tests.engine.test_families import ALL, assert_matches_peft, make_llm

MAX_TOKENS = 4
SAMPLING = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("arch", ["llama", *FAMILIES, "qwen2-yarn"])
def test_every_family_on_the_triton_launchers_matches_peft(checkpoints, tmp_path, triton_launchers, arch):
    base = checkpoints[arch]
    adapters = {"all": build_adapter(base, tmp_path / "all", seed=80, r=4, targets=ALL)}
    llm = make_llm(base, adapters, max_num_batched_tokens=12)
    assert kernels.backend_for(llm.engine.memory.layers[0]) == "triton"
    names = ["all", None, "all"]
    prompts = random_prompts(81, [11, 4, 2])  # longer than the window (8), chunked, and short
    outputs = llm.generate(prompts, SAMPLING, adapters=names)
    assert_matches_peft(Oracle(base, adapters), prompts, names, outputs, max_tokens=MAX_TOKENS)
