"""The MoE families (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) against transformers +
PEFT: base requests, adapters on attention, on the experts (PEFT's target_parameters, every expert its own A and
B) and on both mixed in one batch, chunked prefill over 4-token pages; greedy tokens equal and the top-1
log-probability of every generated token within 1e-4. On the reference ops, and with every op (the experts'
grouped_matmul and expert_lora included) on its Triton launcher under the interpreter."""

import json
import shutil

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM

import kernels
from engine import SamplingParams
from tests.engine.conftest import MOE_FAMILIES, Oracle, build_adapter, build_checkpoint, random_prompts
from tests.engine.test_families import _dequantized_int8, assert_matches_peft, make_llm

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # PEFT's target_parameters on the stacked experts
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
        "experts4": build_adapter(base, root / "experts4", seed=44, r=4, targets=[], target_parameters=EXPERTS),
        "both8": build_adapter(base, root / "both8", seed=45, r=8, alpha=24.0, targets=["q_proj", "o_proj"],
                               target_parameters=EXPERTS, rank_pattern={"down_proj": 2}),
    }
    return arch, base, adapters, Oracle(base, adapters)


def test_mixed_adapter_batch_matches_peft(family):
    arch, base, adapters, oracle = family
    llm = make_llm(base, adapters)
    names = [None, "attn4", "experts4", "both8", "qv8", None, "experts4", "attn4", "both8"]
    prompts = random_prompts(90, [3, 13, 21, 1, 17, 9, 26, 5, 11])
    shared = random_prompts(96, [10])[0]  # one prompt under every adapter and the base
    names += [None, "attn4", "qv8", "experts4", "both8"]
    prompts += [shared] * 5
    outputs = llm.generate(prompts, SAMPLING, adapters=names)
    assert_matches_peft(oracle, prompts, names, outputs)
    # every adapter changes the output: one on the experts that loads but adds nothing would match the base here
    seen = [tuple(round(entry.logprob, 3) for entry in out.logprobs) for out in outputs[-5:]]
    assert len(set(seen)) == 5, f"{arch}: an adapter's output equals another's or the base's"


def test_on_the_triton_launchers_matches_peft(family, triton_launchers):
    arch, base, adapters, oracle = family
    llm = make_llm(base, adapters, max_num_batched_tokens=12)
    assert kernels.backend_for(llm.engine.memory.layers[0]) == "triton"
    names = ["experts4", None, "both8", "attn4"]
    prompts = random_prompts(91, [11, 4, 1, 6])
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1),
                           adapters=names)
    assert_matches_peft(oracle, prompts, names, outputs, max_tokens=4)


def test_two_ranks_equal_one_and_peft(family):
    """Each rank holds its slice of every expert's intermediate (and of the shared expert's): the same tokens and
    log-probabilities over 2 gloo ranks as on one, and as PEFT."""
    arch, base, adapters, oracle = family
    one, two = make_llm(base, adapters), make_llm(base, adapters, tensor_parallel_size=2, max_num_batched_tokens=12)
    names = ["attn4", None, "both8", "experts4"]
    prompts = random_prompts(92, [13, 20, 3, 7])
    experts = [layer.mlp.experts.base for layer in two.engine.runner.model.model.layers
               if hasattr(layer.mlp, "experts")]
    assert experts and experts[0].inter * 2 == one.engine.runner.model.model.layers[0].mlp.experts.base.inter
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
    names = ["attn4", None, "both8"]
    prompts = random_prompts(93, [13, 5, 21])
    assert_matches_peft(oracle, prompts, names, llm.generate(prompts, SAMPLING, adapters=names))


@pytest.mark.parametrize("family", ["mixtral"], indirect=True)
def test_ngram_speculation_keeps_peft_tokens(family):
    arch, base, adapters, oracle = family
    llm = make_llm(base, adapters, speculative_method="ngram", num_speculative_tokens=3)
    names = ["attn4", None, "qv8", "experts4"]
    prompts = [p * 2 for p in random_prompts(94, [7, 9, 5, 6])]  # repeats for the n-gram proposer to find
    outputs = llm.generate(prompts, SAMPLING, adapters=names)
    assert_matches_peft(oracle, prompts, names, outputs)
    assert sum(out.usage.spec_accepted_tokens for out in outputs) > 0


def test_benchmark_smoke(capsys, monkeypatch):
    from benchmarks import moe

    monkeypatch.setattr("sys.argv", ["moe", "--requests", "4", "--adapters", "2", "--layers", "1", "--experts", "4"])
    moe.main()
    out = capsys.readouterr().out
    assert "ratio" in out and "grouped expert matmuls" in out


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"], indirect=True)
def test_expert_names_peft_converts_match_peft(family, tmp_path):
    """target_modules naming the experts' projections (gate/up/down; Mixtral's w1/w3/w2): PEFT turns them into
    target_parameters on the stacked experts, gate_up at twice the rank and alpha (gate's and up's own)."""
    arch, base, _, _ = family
    names_ = ["gate_proj", "up_proj", "down_proj"] if arch != "mixtral" else ["w1", "w3", "w2"]
    path = build_adapter(base, tmp_path / "names", seed=46, r=4, targets=["k_proj", *names_])
    oracle = Oracle(base, {"names": path})
    llm = make_llm(base, {"names": path})
    names = ["names", None, "names"]
    prompts = random_prompts(97, [9, 5, 14])
    assert_matches_peft(oracle, prompts, names, llm.generate(prompts, SAMPLING, adapters=names))


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"], indirect=True)
def test_a_checkpoint_with_stacked_experts_serves_the_same(family, tmp_path):
    """A checkpoint holding the experts already stacked (mlp.experts.gate_up_proj [E, 2I, H], down_proj
    [E, H, I]: the model's own parameters) is read as the per-expert one, whole and split over 2 ranks."""
    arch, base, adapters, oracle = family
    model = AutoModelForCausalLM.from_pretrained(base)
    state = {name: tensor.clone().contiguous() for name, tensor in model.state_dict().items()
             if name != "lm_head.weight" or not model.config.tie_word_embeddings}
    assert any(name.endswith("experts.gate_up_proj") and t.dim() == 3 for name, t in state.items())
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    safetensors.torch.save_file(state, stacked / "model.safetensors", metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, stacked / name)
    names = ["both8", None, "experts4"]
    prompts = random_prompts(98, [7, 12, 4])
    one, two = make_llm(stacked, adapters), make_llm(stacked, adapters, tensor_parallel_size=2)
    try:
        split = two.generate(prompts, SAMPLING, adapters=names)
    finally:
        two.engine.shutdown()
    assert_matches_peft(oracle, prompts, names, one.generate(prompts, SAMPLING, adapters=names))
    assert_matches_peft(oracle, prompts, names, split)


def per_expert_adapter(base, directory, *, arch: str, seed: int, r: int = 4, alpha: float = 8.0):
    """An adapter as PEFT saved them before transformers 5: one LoRA per expert module (and on q_proj)."""
    config = json.loads((base / "config.json").read_text())
    experts, hidden = config.get("num_experts") or config["num_local_experts"], config["hidden_size"]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    names = ("gate_proj", "up_proj", "down_proj") if arch != "mixtral" else ("w1", "w3", "w2")
    parent = "mlp" if arch != "mixtral" else "block_sparse_moe"
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"base_model.model.model.layers.{layer}"
        heads = config["num_attention_heads"]
        q_in, q_out = hidden, heads * (config.get("head_dim") or hidden // heads)
        tensors[f"{prefix}.self_attn.q_proj.lora_A.weight"] = torch.randn(r, q_in, generator=gen) * 0.3 / q_in**0.5
        tensors[f"{prefix}.self_attn.q_proj.lora_B.weight"] = torch.randn(q_out, r, generator=gen) * 0.2
        if layer in (config.get("mlp_only_layers") or []):
            continue
        for expert in range(experts):
            for name in names:
                width_in, width_out = (inter, hidden) if name in ("down_proj", "w2") else (hidden, inter)
                key = f"{prefix}.{parent}.experts.{expert}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, width_in, generator=gen) * 0.3 / width_in**0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(width_out, r, generator=gen) * 0.2
    directory.mkdir()
    safetensors.torch.save_file(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
        "bias": "none", "target_modules": ["q_proj", *names]}))
    return directory


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"], indirect=True)
def test_per_expert_adapters_from_before_transformers_5_match_peft(family, tmp_path):
    """One LoRA per expert module: PEFT stacks them on load (gate and up fused at twice the rank), so does Quilt."""
    arch, base, _, _ = family
    path = per_expert_adapter(base, tmp_path / "per-expert", arch=arch, seed=49)
    oracle = Oracle(base, {"v4": path})
    llm = make_llm(base, {"v4": path})
    prompts = random_prompts(100, [9, 6])
    prompts.append(prompts[0])
    names = ["v4", "v4", None]
    outputs = llm.generate(prompts, SAMPLING, adapters=names)
    assert_matches_peft(oracle, prompts, names, outputs)
    assert [lp.logprob for lp in outputs[0].logprobs] != pytest.approx([lp.logprob for lp in outputs[2].logprobs],
                                                                       abs=1e-3)


@pytest.mark.parametrize("family", ["qwen2-moe"], indirect=True)
def test_lora_on_qwen2_moe_shared_expert_matches_peft(family, tmp_path):
    """On Qwen2-MoE, target_modules naming gate/up/down adapt the shared expert (PEFT finds those modules there and
    converts nothing); with target_parameters the experts and the router too. Over one rank and two."""
    arch, base, _, _ = family
    adapters = {
        "shared4": build_adapter(base, tmp_path / "shared4", seed=47, r=4,
                                 targets=["gate_proj", "up_proj", "down_proj"]),
        "all8": build_adapter(base, tmp_path / "all8", seed=48, r=8,
                              targets=["q_proj", "gate_proj", "down_proj", "up_proj"],
                              target_parameters=[*EXPERTS, "mlp.gate.weight"]),  # the router too
    }
    oracle = Oracle(base, adapters)
    names = ["shared4", None, "all8", None]
    prompts = random_prompts(99, [8, 5, 13])
    prompts.append(prompts[0])  # the shared expert's adapter against the base on one prompt
    one, two = make_llm(base, adapters), make_llm(base, adapters, tensor_parallel_size=2)
    try:
        split = two.generate(prompts, SAMPLING, adapters=names)
    finally:
        two.engine.shutdown()
    outputs = one.generate(prompts, SAMPLING, adapters=names)
    assert_matches_peft(oracle, prompts, names, outputs)
    assert_matches_peft(oracle, prompts, names, split)
    assert [lp.logprob for lp in outputs[0].logprobs] != pytest.approx([lp.logprob for lp in outputs[3].logprobs],
                                                                       abs=1e-3)


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"], indirect=True)
def test_all_linear_adapters_with_the_router_match_peft(family, tmp_path):
    """target_modules="all-linear": PEFT adapts attention, the experts and the router (target_parameters
    `gate.weight`): the router's LoRA changes which experts a token goes to, as in PEFT."""
    arch, base, _, _ = family
    path = build_adapter(base, tmp_path / "all-linear", seed=43, r=4, targets="all-linear")
    oracle = Oracle(base, {"all": path})
    one, two = make_llm(base, {"all": path}), make_llm(base, {"all": path}, tensor_parallel_size=2)
    names = ["all", None, "all"]
    prompts = random_prompts(95, [6, 4, 15])
    try:
        split = two.generate(prompts, SAMPLING, adapters=names)  # the router's LoRA replicated on both ranks
    finally:
        two.engine.shutdown()
    assert_matches_peft(oracle, prompts, names, one.generate(prompts, SAMPLING, adapters=names))
    assert_matches_peft(oracle, prompts, names, split)
