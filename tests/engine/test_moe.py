"""The MoE families of issue 28 (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) against transformers +
PEFT: base requests and adapters on attention mixed in one batch, chunked prefill over 4-token pages; greedy
tokens equal and the top-1 log-probability of every generated token within 1e-4. On the reference ops, and with
every op (the experts' grouped_matmul included) on its Triton launcher under the interpreter."""

import pytest

import kernels
from adapters.errors import AdapterError
from engine import SamplingParams
from kernels import interpreter
from tests.engine.conftest import MOE_FAMILIES, Oracle, build_adapter, build_checkpoint, random_prompts
from tests.engine.test_families import _dequantized_int8, assert_matches_peft, make_llm

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MAX_TOKENS = 8
SAMPLING = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def family(request, tmp_path_factory):
    """(arch, base, adapters, oracle) of one MoE family."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    base = build_checkpoint(root / "base", arch, seed=40 + MOE_FAMILIES.index(arch))
    adapters = {
        "attn4": build_adapter(base, root / "attn4", seed=41, r=4, targets=ATTENTION),
        "qv8": build_adapter(base, root / "qv8", seed=42, r=8, targets=["q_proj", "v_proj"], use_rslora=True),
    }
    return arch, base, adapters, Oracle(base, adapters)


def test_mixed_adapter_batch_matches_peft(family):
    arch, base, adapters, oracle = family
    llm = make_llm(base, adapters)
    names = [None, "attn4", "qv8", "attn4", None, "qv8", "attn4"]
    prompts = random_prompts(90, [3, 13, 21, 1, 17, 9, 26])
    outputs = llm.generate(prompts, SAMPLING, adapters=names)
    assert_matches_peft(oracle, prompts, names, outputs)


@pytest.fixture
def triton_launchers():
    interpreter.enable()
    yield
    interpreter.disable_routing()


def test_on_the_triton_launchers_matches_peft(family, triton_launchers):
    arch, base, adapters, oracle = family
    llm = make_llm(base, adapters, max_num_batched_tokens=12)
    assert kernels.backend_for(llm.engine.memory.layers[0]) == "triton"
    names = ["attn4", None, "qv8"]
    prompts = random_prompts(91, [11, 4, 1])
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1),
                           adapters=names)
    assert_matches_peft(oracle, prompts, names, outputs, max_tokens=4)


def test_two_ranks_equal_one_and_peft(family):
    """Each rank holds its slice of every expert's intermediate (and of the shared expert's): the same tokens and
    log-probabilities over 2 gloo ranks as on one, and as PEFT."""
    arch, base, adapters, oracle = family
    one, two = make_llm(base, adapters), make_llm(base, adapters, tensor_parallel_size=2, max_num_batched_tokens=12)
    names = ["attn4", None, "qv8"]
    prompts = random_prompts(92, [13, 20, 3])
    experts = [layer.mlp.experts for layer in two.engine.runner.model.model.layers if hasattr(layer.mlp, "experts")]
    assert experts and experts[0].inter * 2 == one.engine.runner.model.model.layers[0].mlp.experts.inter
    assert two.engine.state()["tensor_parallel_size"] == 2
    try:
        split = two.generate(prompts, SAMPLING, adapters=names)
    finally:
        two.engine.shutdown()
    whole = one.generate(prompts, SAMPLING, adapters=names)
    assert_matches_peft(oracle, prompts, names, split)
    for out, ref in zip(split, whole, strict=True):
        assert out.token_ids == ref.token_ids
        assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)


@pytest.mark.parametrize("family", ["qwen3-moe"], indirect=True)
def test_int8_matches_peft_on_the_dequantized_base(family, tmp_path):
    """int8 quantizes the attention and dense projections (the experts and the router stay in the model dtype)."""
    arch, base, adapters, _ = family
    oracle = Oracle(_dequantized_int8(base, tmp_path / "int8"), adapters)
    llm = make_llm(base, adapters, quantization="int8")
    names = ["attn4", None, "qv8"]
    prompts = random_prompts(93, [13, 5, 21])
    assert_matches_peft(oracle, prompts, names, llm.generate(prompts, SAMPLING, adapters=names))


@pytest.mark.parametrize("family", ["mixtral"], indirect=True)
def test_ngram_speculation_keeps_peft_tokens(family):
    arch, base, adapters, oracle = family
    llm = make_llm(base, adapters, speculative_method="ngram", num_speculative_tokens=3)
    names = ["attn4", None, "qv8"]
    prompts = [p * 2 for p in random_prompts(94, [7, 9, 5])]  # repeats for the n-gram proposer to find
    outputs = llm.generate(prompts, SAMPLING, adapters=names)
    assert_matches_peft(oracle, prompts, names, outputs)
    assert sum(out.usage.spec_accepted_tokens for out in outputs) > 0


def test_benchmark_smoke(capsys, monkeypatch):
    from benchmarks import moe

    monkeypatch.setattr("sys.argv", ["moe", "--requests", "4", "--adapters", "2", "--layers", "1", "--experts", "4"])
    moe.main()
    out = capsys.readouterr().out
    assert "ratio" in out and "grouped expert matmuls" in out


@pytest.mark.parametrize("family", ["qwen3-moe"], indirect=True)
@pytest.mark.parametrize("targets", [
    {"targets": ["gate_proj", "up_proj", "down_proj"]},  # PEFT turns these into target_parameters on the experts
    {"targets": [], "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]},
], ids=["module-names", "target-parameters"])
def test_adapters_on_the_experts_are_refused_clearly(family, targets, tmp_path):
    """LoRA on the experts is not served yet (docs/models.md): such an adapter is refused, never half-applied."""
    arch, base, adapters, _ = family
    llm = make_llm(base, adapters)
    path = build_adapter(base, tmp_path / "experts", seed=43, r=4, **targets)
    with pytest.raises(AdapterError, match="target_parameters"):
        llm.add_adapter("experts", path)
    names = ["attn4", None]  # the engine still serves the others
    prompts = random_prompts(95, [6, 4])
    assert len(llm.generate(prompts, SAMPLING, adapters=names)) == 2
