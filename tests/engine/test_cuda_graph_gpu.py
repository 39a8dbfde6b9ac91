"""CUDA graphs of the decode step on a GPU (engine/cuda_graph.py): captured and replayed, against the eager
forward (hidden states and greedy tokens, float32 and bfloat16) and against transformers + PEFT; a capture that
fails falls back to eager and says so once. The same contract without a GPU: tests/engine/test_cuda_graph.py.
Run on a GPU machine with `pytest -m gpu tests/engine/test_cuda_graph_gpu.py`."""

import logging

import pytest
import torch

from engine import SamplingParams
from tests.engine.conftest import Oracle, random_prompts
from tests.engine.test_cuda_graph import (
    DecodeSteps,
    adapter_dirs,  # noqa: F401 (fixture)
    eager_forward,
    make_llm,
    static_forward,
    storage_seen,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GPU = {"device": "cuda", "block_size": 16, "num_kv_blocks": 96}
NAMES = ["all4", None, "all8", "qv2", "all8", None, "all4", "qv2", "all8"]  # 9 sequences, at most 8 a step


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replayed_graphs_match_the_eager_forward(checkpoints, adapter_dirs, dtype):  # noqa: F811
    llm = make_llm(checkpoints, adapter_dirs, static=False, dtype=dtype, **GPU)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.capture, "CUDA graphs are on by default on CUDA"
    steps, model = DecodeSteps(llm, seed=5), llm.engine.runner.model
    mixes = [(["all4", None, "all8"], [50, 17, 3]), (["qv2", "all8", None, "qv2"], [33, 1, 140, 64]),
             (["all8"] * 6 + [None, "all4"], [9, 18, 27, 36, 45, 54, 63, 72]), ([None, None], [6, 130])]
    tolerance = 1e-4 if dtype == "float32" else 5e-2  # bf16: a padded GEMM may round otherwise
    with storage_seen(model) as seen:
        for adapters, lens in mixes:
            inputs = steps.step(adapters, lens)
            got = static_forward(llm, inputs)
            want = eager_forward(llm, inputs)
            torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
            if dtype == "float32":
                assert model.compute_logits(got).argmax(-1).tolist() == model.compute_logits(want).argmax(-1).tolist()
    assert set(graphs.graphs) == {(4, True), (8, True), (2, False)}  # one graph served both 4-row mixes
    assert graphs.failure is None and graphs.steps == 4
    static_reads = [s for s in seen if s["input_ids"] == graphs.buffers["input_ids"].data_ptr()]
    assert len(static_reads) == 6  # each graph's warm-up and capture: replays run no Python


def test_graphs_are_captured_again_when_the_lora_buffers_move(checkpoints, adapter_dirs, caplog):  # noqa: F811
    llm = make_llm(checkpoints, adapter_dirs, static=False, **GPU)
    runner, steps = llm.engine.runner, DecodeSteps(llm, seed=6)
    inputs = steps.step(["all4", None, "qv2"], [20, 7, 33])
    torch.testing.assert_close(static_forward(llm, inputs), eager_forward(llm, inputs), rtol=1e-4, atol=1e-4)
    runner.lora.reserve(max_adapters=4 * runner.lora.max_adapters)  # a step with more adapters would do this
    inputs = steps.step(["all8", "qv2", None], [12, 40, 3])
    with caplog.at_level(logging.INFO, logger="engine.cuda_graph"):
        got = static_forward(llm, inputs)
    assert any("moved" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(got, eager_forward(llm, inputs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_with_graphs_equal_eager(checkpoints, adapter_dirs, dtype):  # noqa: F811
    prompts = random_prompts(94, [7, 30, 3, 12, 19, 5, 8, 2, 25])
    sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    outputs = {}
    for graphs in (True, False):
        llm = make_llm(checkpoints, adapter_dirs, static=False, dtype=dtype, cuda_graphs=graphs, **GPU)
        outputs[graphs] = llm.generate(prompts, sampling, adapters=NAMES)
        assert (llm.engine.runner.graphs is not None) == graphs
        if graphs:
            assert llm.engine.runner.graphs.steps > 0
        llm.close()
    for with_graphs, eager in zip(outputs[True], outputs[False], strict=True):
        assert with_graphs.token_ids == eager.token_ids


def test_graphs_match_peft(checkpoints, adapter_dirs):  # noqa: F811
    llm = make_llm(checkpoints, adapter_dirs, static=False, **GPU)
    prompts = random_prompts(95, [6, 3, 10, 2, 5, 9, 4, 7, 1])
    sampling = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, sampling, adapters=NAMES)
    assert llm.engine.runner.graphs.steps >= 4
    oracle = Oracle(checkpoints["llama"], adapter_dirs)
    for prompt, name, out in zip(prompts, NAMES, outputs, strict=True):  # float32 on CUDA: the same tokens
        tokens, _ = oracle.greedy_cached(prompt, name, 5)
        assert out.token_ids == tokens, name


def test_a_failed_capture_falls_back_to_eager_and_says_so_once(checkpoints, adapter_dirs, caplog):  # noqa: F811
    llm = make_llm(checkpoints, adapter_dirs, static=False, **GPU)
    model = llm.engine.runner.model

    def sync_while_capturing(module, args) -> None:
        if torch.cuda.is_current_stream_capturing():
            args[1].sum().item()  # a host read: illegal while a graph is captured

    model.model.layers[0].register_forward_pre_hook(sync_while_capturing)
    prompts = random_prompts(96, [4, 9, 2])
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="engine.cuda_graph"):
        got = llm.generate(prompts, sampling, adapters=["all4", None, "qv2"])
    failures = [r for r in caplog.records if "capture failed" in r.getMessage()]
    assert len(failures) == 1 and llm.engine.runner.graphs.failure is not None
    eager = make_llm(checkpoints, adapter_dirs, static=False, cuda_graphs=False, **GPU)
    want = eager.generate(prompts, sampling, adapters=["all4", None, "qv2"])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
