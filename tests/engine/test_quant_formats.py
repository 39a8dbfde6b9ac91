"""Pre-quantized checkpoints: GPTQ (v1, v2, act order, 4 and 8 bits), AWQ (gemm) and compressed-tensors
(pack-quantized W4A16 / W8A16, naive-quantized int8), loaded as stored and served with LoRA on top.

Oracle: transformers + PEFT on the dequantized twin of each checkpoint (tests/engine/quantized_checkpoints.py:
W = (q - z) * s from the integers before packing; for compressed-tensors, the package's own decompression).
transformers itself does not load these on CPU: GPTQ and AWQ need gptqmodel / autoawq and their CUDA kernels,
and its compressed-tensors path rejects packed zero points of asymmetric schemes (a size mismatch at load)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.models import load_model
from engine.quantization import FORMATS, read_quant_spec
from engine.quantization.experts import PackedExperts
from tests.engine.conftest import Oracle, build_adapter, build_checkpoint, random_prompts
from tests.engine.fp8_checkpoints import build_base, write_compressed_tensors
from tests.engine.quantized_checkpoints import compressed_tensors_decompress, write_quantized
from tests.engine.test_families import assert_matches_peft

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = {  # name: write_quantized's settings
    "gptq-v1-w4-g32-sym": dict(fmt="gptq", bits=4, group_size=32, sym=True),
    "gptq-v1-w4-g32-asym-act-order": dict(fmt="gptq", bits=4, group_size=32, sym=False, act_order=True),
    "gptq-v2-w4-g32-asym-act-order": dict(fmt="gptq_v2", bits=4, group_size=32, sym=False, act_order=True),
    "gptq-v2-w8-channel-sym": dict(fmt="gptq_v2", bits=8, group_size=-1, sym=True),
    "awq-w4-g32": dict(fmt="awq", bits=4, group_size=32, sym=False),
    "ct-pack-w4a16-g32-asym": dict(fmt="pack", bits=4, group_size=32, sym=False),
    "ct-pack-w8a16-channel-sym": dict(fmt="pack", bits=8, group_size=-1, sym=True),
    "ct-naive-int8-channel": dict(fmt="naive", bits=8, group_size=-1, sym=True),
}
NAMES = ["all8", None, "qv4", "mlp16", "all8"]
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # PEFT's target_parameters


@pytest.fixture(scope="module")
def llama_adapters(checkpoints, tmp_path_factory):
    root, base = tmp_path_factory.mktemp("quant-format-adapters"), checkpoints["llama"]
    return {
        "all8": build_adapter(base, root / "all8", seed=40, r=8, targets=ALL),
        "qv4": build_adapter(base, root / "qv4", seed=41, r=4, targets=["q_proj", "v_proj"]),
        "mlp16": build_adapter(base, root / "mlp16", seed=42, r=16, targets=["gate_proj", "up_proj", "down_proj"]),
    }


@pytest.fixture(scope="module")
def quantized(checkpoints, tmp_path_factory):
    """(case, family) -> (quantized checkpoint, dequantized twin), written once per module."""
    root, made = tmp_path_factory.mktemp("quantized"), {}

    def get(name: str, arch: str = "llama"):
        if (name, arch) not in made:
            made[name, arch] = write_quantized(checkpoints[arch], root / f"{arch}-{name}", seed=3, **CASES[name])
        return made[name, arch]
    return get


def check_against_oracle(model_dir, dequantized, adapters, *, lengths=(3, 14, 9, 1, 11), names=NAMES,
                         max_tokens: int = 6, oracle_adapters: dict | None = None, **config) -> LLM:
    """Greedy tokens identical and prompt log-probabilities within 1e-4 of transformers + PEFT on the dequantized
    twin, for base and adapter requests in one batch. oracle_adapters: what PEFT runs for each adapter where it
    cannot load the engine's (Phi-3's split names: tests/engine/test_phi3.py fused_equivalent)."""
    oracle = Oracle(dequantized, oracle_adapters or adapters)
    llm = LLM(model_dir, device="cpu", max_num_seqs=8, num_kv_blocks=128, block_size=4, **config)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    prompts = random_prompts(36, list(lengths))
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate(prompts, greedy, adapters=list(names))
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        assert out.token_ids == oracle.greedy(prompt, name, max_tokens), f"adapter {name}"
        expected = torch.log_softmax(oracle.logits(prompt, name), -1)
        got = [lp.logprob for lp in (out.prompt_logprobs or [None])[1:]]
        want = [float(expected[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
        assert got == pytest.approx(want, abs=1e-4), f"adapter {name}"
    return llm


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_peft_on_the_dequantized_checkpoint(quantized, llama_adapters, case):
    model_dir, dequantized = quantized(case)
    llm = check_against_oracle(model_dir, dequantized, llama_adapters)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.base
    assert type(qkv).__name__ == FORMATS[read_quant_spec(json.loads((model_dir / "config.json").read_text())).scheme
                                         ].__name__
    assert qkv.qweight.dtype == torch.int32  # served packed: nothing dequantized at load
    # act order: channels sorted by group at load, so every format takes the kernel's in-order path
    assert qkv.group_size == (64 if CASES[case]["group_size"] == -1 else 32)
    assert (qkv.perm is not None) == CASES[case].get("act_order", False)
    memory = llm.engine.state()["memory"]  # /v1/state's
    assert memory["quantization"].startswith(case.split("-")[0].replace("ct", "compressed-tensors"))
    # the weights the page budget is left after: packed (fp32 embeddings and lm_head are most of what remains)
    assert memory["base_weights_bytes"] < 0.5 * memory["base_weights_full_precision_bytes"]


def test_engine_on_the_triton_launchers_matches_peft(quantized, llama_adapters, triton_launchers):
    """The GEMM every integer format is served by (after repacking: AWQ and compressed-tensors reach it in the same
    layout), with act order and zero points, under Triton's interpreter with every other op on its launcher."""
    check_against_oracle(*quantized("gptq-v2-w4-g32-asym-act-order"), llama_adapters, lengths=(3, 9, 1),
                         names=("all8", None, "mlp16"), max_tokens=3)


@pytest.mark.parametrize(("arch", "case"), [("qwen2", "gptq-v1-w4-g32-asym-act-order"), ("qwen3", "awq-w4-g32"),
                                          ("qwen3", "ct-pack-w4a16-g32-asym"), ("qwen2", "ct-pack-w8a16-channel-sym"),
                                          ("qwen3", "ct-naive-int8-channel")])
def test_qwen_families_match_peft(checkpoints, quantized, tmp_path, arch, case):
    """Qwen2 (q/k/v biases beside the packed weights, tied embeddings) and Qwen3 (head_dim 24 apart from
    hidden / heads, q/k norms)."""
    adapters = {"all8": build_adapter(checkpoints[arch], tmp_path / "all8", seed=43, r=8, targets=ALL)}
    check_against_oracle(*quantized(case, arch), adapters, lengths=(3, 14, 9), names=("all8", None, "all8"))


@pytest.mark.parametrize(("arch", "case", "tp"), [("qwen3-moe", "gptq-v2-w4-g32-asym-act-order", 1),
                                                ("mixtral", "awq-w4-g32", 1), ("qwen3-moe", "ct-pack-w8a16-channel-sym", 1),
                                                ("mixtral", "gptq-v1-w4-g32-asym-act-order", 2),
                                                ("qwen2-moe", "gptq-v2-w8-channel-sym", 1)])
def test_moe_families_with_quantized_experts_match_peft(tmp_path, arch, case, tp):
    """Every expert quantized (Mixtral's w1/w2/w3 names too), served stacked by the grouped W4A16 GEMM; LoRA on
    attention and on the experts (PEFT target_parameters) on top; the router stays in full precision. On two
    ranks each holds every expert's half of the intermediate: gate/up by output columns, down by input rows.
    Qwen2-MoE: its shared expert quantized too, as a dense gated MLP (widths 40 and 56: per-channel scales)."""
    base = build_checkpoint(tmp_path / arch, arch, seed=5, **({"moe_intermediate_size": 64} if arch == "qwen3-moe"
                                                               else {}))
    model_dir, dequantized = write_quantized(base, tmp_path / case, seed=3, **CASES[case])
    adapters = {"attn8": build_adapter(base, tmp_path / "attn8", seed=44, r=8, targets=["q_proj", "v_proj", "o_proj"]),
                "experts4": build_adapter(base, tmp_path / "experts4", seed=45, r=4, targets=[],
                                          target_parameters=EXPERT_PARAMETERS)}
    llm = check_against_oracle(model_dir, dequantized, adapters, lengths=(3, 14, 9, 6),
                               names=("attn8", None, "experts4", "attn8"), tensor_parallel_size=tp)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts.base
    assert isinstance(experts, PackedExperts) and experts.gate_up_proj_qweight.dtype == torch.int32
    if arch == "qwen2-moe":
        shared = llm.engine.runner.model.model.layers[0].mlp.shared_expert
        assert type(shared.gate_up_proj.base).__name__ == type(shared.down_proj.base).__name__ == "GPTQLinear"


@pytest.mark.parametrize("case", ["gptq-v2-w4-g32-asym-act-order"])
def test_two_tensor_parallel_ranks_load_their_shards_and_match_peft(quantized, llama_adapters, case):
    """Each rank reads its part of the packed weights: q/k/v and gate/up by output columns (packed zeros too), o and
    down by input rows with the act-order g_idx split alike and the scales whole."""
    check_against_oracle(*quantized(case), llama_adapters, lengths=(3, 14, 9), names=("all8", None, "mlp16"),
                         max_tokens=4, tensor_parallel_size=2)


def test_a_tensor_parallel_split_inside_a_group_is_refused(quantized):
    """down_proj's 96 inputs over two ranks are 48 each: not whole groups of 32 (without act order each rank
    would need scales of a group it holds half of)."""
    with pytest.raises(ValueError, match="down_proj: 48 inputs on this rank is not a whole number of groups of 32"):
        LLM(quantized("awq-w4-g32")[0], device="cpu", num_kv_blocks=16, tensor_parallel_size=2)


# bad input: a clear error at start

def _rewrite(model_dir, tmp_path, *, config=None, tensors=None):
    """A copy of a checkpoint with its quantization_config updated and some tensors replaced (None: dropped)."""
    out = tmp_path / "bad"
    out.mkdir()
    for path in model_dir.iterdir():
        if path.name not in ("config.json", "model.safetensors"):
            (out / path.name).write_bytes(path.read_bytes())
    hf = json.loads((model_dir / "config.json").read_text())
    hf["quantization_config"].update(config or {})
    (out / "config.json").write_text(json.dumps(hf))
    state = load_file(str(model_dir / "model.safetensors"))
    for name, tensor in (tensors or {}).items():
        if tensor is None:
            del state[name]
        else:
            state[name] = tensor
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _load(model_dir):
    return load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"))


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(("config", "message"), [
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes' .*not supported; supported: gptq, awq, compressed-tensors"),
    ({"bits": 3}, "3-bit weights are not served; the kernels take 4 or 8 bits"),
    ({"group_size": 16}, "group size 16 is not served"),
    ({"checkpoint_format": "marlin"}, "checkpoint format 'marlin' is not served"),
])
def test_unsupported_settings_are_refused_naming_them(quantized, tmp_path, config, message):
    bad = _rewrite(quantized("gptq-v2-w4-g32-asym-act-order")[0], tmp_path, config=config)
    with pytest.raises(ValueError, match=message):
        _load(bad)
    with pytest.raises(ValueError, match=message):  # the engine refuses before loading anything
        LLM(bad, device="cpu", num_kv_blocks=16)


def test_a_packed_tensor_of_the_wrong_shape_is_refused(quantized, tmp_path):
    model_dir = quantized("gptq-v2-w4-g32-asym-act-order")[0]
    qweight = load_file(str(model_dir / "model.safetensors"))[f"{Q}.qweight"]
    bad = _rewrite(model_dir, tmp_path, tensors={f"{Q}.qweight": qweight[:, :-8].contiguous()})
    with pytest.raises(ValueError, match=r"qkv_proj: qweight of slice 0 has shape \(8, 56\), expected \(8, 64\)"):
        _load(bad)


@pytest.mark.parametrize(("case", "kind"), [("gptq-v2-w4-g32-asym-act-order", "scales"),
                                            ("awq-w4-g32", "qzeros"),
                                            ("ct-pack-w4a16-g32-asym", "weight_zero_point")])
def test_missing_scales_or_zeros_are_refused(quantized, tmp_path, case, kind):
    bad = _rewrite(quantized(case)[0], tmp_path, tensors={f"model.layers.1.mlp.down_proj.{kind}": None})
    with pytest.raises(ValueError, match=f"down_proj: the checkpoint has no {kind}"):
        _load(bad)


def test_a_g_idx_that_is_not_a_permutation_is_refused(quantized, tmp_path):
    g_idx = torch.zeros(96, dtype=torch.int32)  # every channel in group 0
    bad = _rewrite(quantized("gptq-v2-w4-g32-asym-act-order")[0], tmp_path,
                   tensors={"model.layers.0.mlp.down_proj.g_idx": g_idx})
    with pytest.raises(ValueError, match="g_idx is not a permutation of the input channels into groups of 32"):
        _load(bad)


def test_quantizing_a_quantized_checkpoint_on_load_is_refused(quantized):
    with pytest.raises(ValueError, match="already quantized"):
        LLM(quantized("awq-w4-g32")[0], device="cpu", num_kv_blocks=16, quantization="int8")


@pytest.mark.parametrize(("suite", "engine", "quantization", "bytes_ratio"), [
    ("w4a16", "w4a16", "gptq w4 g128 sym", 0.5), ("fp8ckpt", "fp8", "fp8 fp8 block 128x128", 0.6)])
def test_quantized_checkpoints_benchmark_smoke(tmp_path, capsys, suite, engine, quantization, bytes_ratio):
    """benchmarks/quantized_checkpoints.py (the GPU suite's w4a16 and fp8ckpt steps) end to end on its tiny shape:
    each suite's writer, both engines, the table (CPU speed says nothing about the GPU's)."""
    from benchmarks import quantized_checkpoints

    assert quantized_checkpoints.main(["--suite", suite, "--batches", "2", "--rounds", "1", "--adapters", "2",
                                       "--json", str(tmp_path / "report.json")]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["quantization"] == quantization
    assert report["weights_bytes"][engine] < bytes_ratio * report["weights_bytes"]["bf16"]
    assert "| 2 | 2 |" in capsys.readouterr().out


def _one_projection(packed_cls, spec, in_features: int, out_features: int, stored: dict):
    """One projection of format `packed_cls` loaded from its stored tensors and finished, as the loader does."""
    from engine.models.linear import Linear

    with torch.device("meta"):
        module = packed_cls(Linear(in_features, [out_features], bias=False), spec, name="proj",
                            dtypes={kind: t.dtype for kind, t in stored.items()})
    module.to_empty(device="cpu")
    for kind, tensor in stored.items():
        module.load_slice(0, kind, tensor)
    module.finish()
    return module


def test_gptq_v1_zero_of_zero_wraps_as_autogptq_reads_it():
    """v1 stores z - 1 in `bits` bits, so a zero of 0 is stored as 15 and read back as (15 + 1) & 15 = 0
    (AutoGPTQ's dequantization); v2 stores 0. Both give the same weight."""
    from engine.quantization.gptq import GPTQLinear
    from engine.quantization.spec import QuantSpec
    from tests.engine.quantized_checkpoints import Quantized, gptq_tensors

    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (16, 64), generator=gen, dtype=torch.int32)
    zeros = torch.tensor([[0] * 8 + [15] * 8, [7] * 16], dtype=torch.int32)  # [G, out]: zeros of 0 and of 15
    qz = Quantized(q, zeros, (torch.rand(2, 16, generator=gen) + 0.1).half(), (torch.arange(64) // 32).int())
    for fmt in ("gptq", "gptq_v2"):
        stored = gptq_tensors(qz, bits=4, v1=fmt == "gptq")
        spec = QuantSpec(method="gptq", format=fmt, bits=4, group_size=32, symmetric=False)
        module = _one_projection(GPTQLinear, spec, 64, 16, stored)
        x = torch.randn(3, 64, generator=gen)
        torch.testing.assert_close(module(x), x @ qz.dequantized().t(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["gptq-v2-w4-g32-asym-act-order", "awq-w4-g32"])
def test_static_decode_makes_no_host_sync_on_the_triton_launchers(tmp_path, triton_launchers, case):
    """What a CUDA graph captures (engine/cuda_graph.py): the decode forward through the static buffers, with the
    packed projections on their Triton launchers, reads nothing back. (MoE models decode eagerly: graph_unsupported;
    the grouped GEMM reads nothing back either, kernels.grouped_matmul's row blocks.)"""
    from tests.engine.test_cuda_graph import check_no_host_sync, make_llm

    base = build_checkpoint(tmp_path / "llama", "llama", seed=6, num_layers=1)
    model_dir, _ = write_quantized(base, tmp_path / case, seed=3, **CASES[case])
    check_no_host_sync(make_llm({case: model_dir}, {}, static=True, arch=case, max_num_seqs=4), [None, None, None])


@pytest.fixture(scope="module")
def actorder_static(tmp_path_factory):
    """A W4A16 checkpoint written by compressed-tensors itself with actorder "static" (llm-compressor's
    GPTQModifier default), on a Llama of hidden 128 and intermediate 256 (groups of 128), adapters on it, and
    transformers + PEFT on its twin decompressed by compressed-tensors' own compressor as the oracle (PEFT
    cannot wrap the Linears transformers leaves packed until their first forward)."""
    root = tmp_path_factory.mktemp("actorder-static")
    base = build_base(root / "base", "llama", seed=80)
    directory = write_compressed_tensors(base, root / "w4a16", preset="W4A16", calibration=random_prompts(81, [9]),
                                         actorder="static")
    adapters = {"all8": build_adapter(base, root / "all8", seed=82, r=8, targets=ALL),
                "qv4": build_adapter(base, root / "qv4", seed=83, r=4, targets=["q_proj", "v_proj"])}
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    stored, twin = load_file(str(directory / "model.safetensors")), load_file(str(base / "model.safetensors"))
    for name in [name for name in stored if name.endswith(".weight_packed")]:
        prefix = name.removesuffix(".weight_packed")
        parts = {kind: stored[f"{prefix}.{kind}"] for kind in ("weight_packed", "weight_scale", "weight_shape")}
        twin[f"{prefix}.weight"] = compressed_tensors_decompress(parts, config)
    dequantized = root / "w4a16-dequantized"
    shutil.copytree(base, dequantized)
    save_file(twin, str(dequantized / "model.safetensors"), metadata={"format": "pt"})
    return directory, adapters, Oracle(dequantized, adapters)


def _serve_actorder_static(actorder_static, max_tokens: int) -> None:
    directory, adapters, oracle = actorder_static
    weights = json.loads((directory / "config.json").read_text())["quantization_config"]["config_groups"][
        "group_0"]["weights"]
    assert weights["actorder"] == "static" and weights["strategy"] == "group"
    assert not [name for name in load_file(str(directory / "model.safetensors")) if "g_idx" in name]
    llm = LLM(directory, device="cpu", max_num_seqs=8, num_kv_blocks=128, block_size=4)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.base
    assert qkv.perm is None and qkv.group_size == 128  # in order: no act order to sort
    prompts, names = random_prompts(84, [3, 11, 6]), ["all8", None, "qv4"]
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    assert_matches_peft(oracle, prompts, names, llm.generate(prompts, sampling, adapters=names), max_tokens)


def test_compressed_tensors_actorder_static_is_served_as_in_order(actorder_static):
    """compressed-tensors' ActivationOrdering: "static" is an alias of "weight", which orders the calibration and
    leaves the stored format as without act order (no g_idx): served token-identical to transformers + PEFT."""
    _serve_actorder_static(actorder_static, max_tokens=5)


def test_compressed_tensors_actorder_static_on_the_triton_launchers(actorder_static, triton_launchers):
    _serve_actorder_static(actorder_static, max_tokens=3)


@pytest.mark.parametrize("actorder", ["group", "dynamic", True])
def test_compressed_tensors_actorder_with_g_idx_is_refused_naming_it(actorder_static, tmp_path, actorder):
    """"group" (alias "dynamic", and the old `true`) stores g_idx: not served for compressed-tensors, refused
    naming the field and its value."""
    directory = actorder_static[0]
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    group = config["config_groups"]["group_0"]
    groups = {"group_0": {**group, "weights": {**group["weights"], "actorder": actorder}}}
    with pytest.raises(ValueError, match=f"weights actorder {actorder!r} \\(act order, g_idx stored\\) is not served"):
        _load(_rewrite(directory, tmp_path, config={"config_groups": groups}))


def test_awq_layout_is_autoawqs():
    """AWQ's gemm layout as AutoAWQ 0.2.9's own code packs it (WQLinear_GEMM.from_linear) and dequantizes it on CPU
    (dequantize_gemm): tests/engine/fixtures/make_autoawq_gemm.py wrote the fixture. The engine's AWQLinear, loading
    those tensors, serves AutoAWQ's weight (rounded to float16 as AutoAWQ computes it, the same bits); and this
    suite's own AWQ writer packs AutoAWQ's words."""
    from pathlib import Path

    from engine.quantization.awq import AWQLinear, awq_unpack
    from engine.quantization.spec import QuantSpec
    from tests.engine.quantized_checkpoints import Quantized, awq_tensors

    fixture = load_file(str(Path(__file__).parent / "fixtures" / "autoawq_gemm.safetensors"))
    stored = {kind: fixture[kind] for kind in ("qweight", "qzeros", "scales")}
    expected = fixture["dequantized"].float()  # [in, out]
    spec = QuantSpec(method="awq", format="gemm", bits=4, group_size=32, symmetric=False)
    module = _one_projection(AWQLinear, spec, 128, 64, stored)
    weight = module(torch.eye(128))  # [in, out]: (q - z) * s in float32; AutoAWQ takes it in float16
    assert torch.equal(weight.half(), fixture["dequantized"])
    assert (weight - expected).abs().max() > 0  # the comparison is not vacuous: the two roundings differ
    q, zeros = awq_unpack(stored["qweight"]).t(), awq_unpack(stored["qzeros"])  # [out, in], [G, out]
    ours = awq_tensors(Quantized(q, zeros, stored["scales"], (torch.arange(128) // 32).int()))
    assert torch.equal(ours["qweight"], stored["qweight"]) and torch.equal(ours["qzeros"], stored["qzeros"])
