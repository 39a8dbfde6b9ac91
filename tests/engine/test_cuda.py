"""The engine on CUDA (Triton kernels) against transformers + PEFT in float32 on CPU.

bfloat16 changes the numbers, so log-probabilities are compared with a tolerance rather than
tokens for identity. Run on a GPU machine with `pytest -m gpu tests/engine/test_cuda.py`.
"""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.conftest import Oracle, build_adapter, random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def setup(checkpoints, tmp_path_factory):
    root, base = tmp_path_factory.mktemp("cuda-adapters"), checkpoints["llama"]
    adapters = {
        "qv": build_adapter(base, root / "qv", seed=50, r=8, targets=["q_proj", "v_proj"]),
        "all": build_adapter(base, root / "all", seed=51, r=32, targets=ALL, use_rslora=True),
    }
    return base, adapters, Oracle(base, adapters)


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 2e-3), ("bfloat16", 0.15)])
def test_prompt_logprobs_close_to_peft_on_cuda(setup, dtype, tolerance):
    base, adapters, oracle = setup
    llm = LLM(base, device="cuda", dtype=dtype, block_size=16, num_kv_blocks=64, max_num_batched_tokens=24)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    names = ["qv", None, "all", "qv", "all"]
    prompts = random_prompts(60, [7, 30, 12, 19, 3])
    sampling = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0, ignore_eos=True)
    outputs = llm.generate(prompts, sampling, adapters=names)
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        reference = torch.log_softmax(oracle.logits(prompt, name), dim=-1)
        got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
        want = torch.tensor([float(reference[i - 1, prompt[i]]) for i in range(1, len(prompt))])
        assert (got - want).abs().max() < tolerance, (name, dtype)
        if dtype == "float32":
            assert out.token_ids[:1] == oracle.greedy(prompt, name, 1)
