"""FP8 checkpoints served as stored (engine/quantization/fp8.py, fp8_experts.py) against transformers + PEFT
loading the same files: `fp8` with weight_block_size [128, 128] (transformers dequantizes it on CPU) and
compressed-tensors float-quantized (transformers with compressed-tensors, which quantizes the activations as the
checkpoint says: static per-tensor or dynamic per-token). Base and adapter requests in one mixed batch, adapters
on fused q/k/v and gate/up and on FP8 experts; greedy tokens identical and each token's log-probability within
1e-4, on the references and on the Triton launchers under the interpreter; over two tensor-parallel ranks; and
the refusals at start (tests/engine/fp8_checkpoints.py writes the checkpoints with the formats' producers)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import kernels
from engine import LLM, SamplingParams
from engine.quantization.fp8 import CompressedFp8Linear, Fp8BlockLinear
from engine.quantization.fp8_experts import Fp8Experts
from tests.engine.conftest import Oracle, build_adapter, random_prompts
from tests.engine.fp8_checkpoints import (
    block_oracle,
    build_base,
    quantize_expert_inputs,
    write_block_fp8,
    write_compressed_tensors,
    write_gptqmodel_block_fp8,
)
from tests.engine.test_families import assert_matches_peft, make_llm

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # PEFT's target_parameters on stacked experts
CASES = {  # id -> (arch, format)
    "llama-block": ("llama", "block"),
    "llama-static": ("llama", "static"),
    "llama-dynamic": ("llama", "dynamic"),
    "qwen3-block": ("qwen3", "block"),
    "qwen3-dynamic": ("qwen3", "dynamic"),
    "qwen3-moe-block": ("qwen3-moe", "block"),
    "mixtral-block": ("mixtral", "block"),
    "qwen3-moe-dynamic": ("qwen3-moe", "dynamic"),  # compressed-tensors experts: per-channel, dynamic per token
    "mixtral-static": ("mixtral", "static"),  # per-tensor weights, static input scales per expert
    "llama-inverse": ("llama", "inverse"),  # GPTQModel's block scales: weight / weight_scale_inv
    "qwen3-moe-inverse": ("qwen3-moe", "inverse"),
}
WEIGHT_ONLY = ("block", "inverse")  # the weight dequantized, the activations as they are
SEEDS = {"llama": 60, "qwen3": 61, "qwen3-moe": 62, "mixtral": 63}
MAX_TOKENS = 6
SAMPLING = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """arch -> (fp32 base, its adapters), built once."""
    built = {}

    def get(arch: str):
        if arch not in built:
            root = tmp_path_factory.mktemp(f"fp8-{arch}")
            base = build_base(root / "base", arch, seed=SEEDS[arch])
            moe = arch in ("qwen3-moe", "mixtral")
            adapters = {  # fused q/k/v and gate/up slices under one adapter, ranks apart
                "all8": build_adapter(base, root / "all8", seed=64, r=8, targets=ALL[:4] if moe else ALL),
                "qkv4": build_adapter(base, root / "qkv4", seed=65, r=4, targets=["q_proj", "k_proj", "v_proj"]),
                "mlp4": (build_adapter(base, root / "experts4", seed=66, r=4, targets=["o_proj"],
                                       target_parameters=EXPERTS) if moe else
                         build_adapter(base, root / "mlp4", seed=66, r=4, targets=["gate_proj", "up_proj"])),
            }
            built[arch] = (base, adapters)
        return built[arch]

    return get


@pytest.fixture(scope="module")
def fp8(families, tmp_path_factory):
    """case id -> (arch, the FP8 checkpoint, adapters, transformers + PEFT on that checkpoint), built once."""
    made = {}

    def get(case: str):
        if case not in made:
            arch, fmt = CASES[case]
            base, adapters = families(arch)
            directory = tmp_path_factory.mktemp(f"fp8-{case}") / "model"
            if fmt == "block":
                write_block_fp8(base, directory)
            elif fmt == "inverse":  # the oracle: the model dequantized as weight / weight_scale_inv, in the test
                dequantized = write_gptqmodel_block_fp8(base, directory)
            else:
                pytest.importorskip("compressed_tensors")  # requirements/dev.txt; not on the GPU machine's image
                preset = "FP8" if fmt == "static" else "FP8_DYNAMIC"
                write_compressed_tensors(base, directory, preset=preset, calibration=random_prompts(67, [9, 21, 14]))
            oracle = (block_oracle(directory, adapters) if fmt == "block" else
                      Oracle(dequantized, adapters) if fmt == "inverse" else Oracle(directory, adapters))
            if fmt not in WEIGHT_ONLY and arch in ("qwen3-moe", "mixtral"):
                quantize_expert_inputs(oracle.base, directory)  # transformers runs experts in full precision
            made[case] = (arch, directory, adapters, oracle)
        return made[case]

    return get


def test_the_block_oracle_is_dequantized_where_cuda_is_visible(fp8, monkeypatch):
    """The oracle's model loaded as on the GPU machine (CUDA visible, compute capability 9.0; no adapters: PEFT's
    safetensors would pin memory): no FP8Linear or FP8Experts, and the logits it gives on this CPU. Without
    `dequantize` transformers keeps those there, and the first forward raises ImportError: finegrained-fp8 kernel
    unavailable (`kernels` is not installed)."""
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

    for case in ("llama-block", "qwen3-moe-block"):
        _, directory, _, on_cpu = fp8(case)
        with monkeypatch.context() as patched:
            patched.setattr(torch.cuda, "is_available", lambda: True)
            patched.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
            oracle = block_oracle(directory, {})
        assert not [m for m in oracle.base.modules() if isinstance(m, (FP8Linear, FP8Experts))], case
        prompt = random_prompts(71, [7])[0]
        torch.testing.assert_close(oracle.logits(prompt, None), on_cpu.logits(prompt, None), atol=0, rtol=0)


def _mixed_batch():
    names = [None, "all8", "qkv4", "mlp4", "all8", None, "mlp4"]
    return random_prompts(68, [3, 13, 9, 1, 17, 6, 11]), names


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_checkpoint_matches_transformers_and_peft(fp8, case):
    arch, directory, adapters, oracle = fp8(case)
    llm = make_llm(directory, adapters)
    model = llm.engine.runner.model
    stored = [m for m in model.modules() if isinstance(m, (Fp8BlockLinear, CompressedFp8Linear, Fp8Experts))]
    assert stored and all(m.gate_up_proj.dtype == torch.float8_e4m3fn if isinstance(m, Fp8Experts) else
                          m.weight.dtype == torch.float8_e4m3fn for m in stored)  # held as stored
    prompts, names = _mixed_batch()
    outputs = llm.generate(prompts, SAMPLING, adapters=names)
    if CASES[case][1] in WEIGHT_ONLY:  # weight-only: the same function as transformers' dequantized model
        assert_matches_peft(oracle, prompts, names, outputs, MAX_TOKENS)
    else:
        assert_matches_peft_with_quantized_activations(oracle, prompts, names, outputs)


def assert_matches_peft_with_quantized_activations(oracle, prompts, names, outputs, *,
                                                   max_apart: int = 1) -> None:
    """Every log-probability within 1e-4 of transformers' on the same sequence, in every sequence of the batch but
    at most `max_apart`, whose log-probabilities stay within 0.15; every generated token transformers' top-1, unless its
    top two are closer than twice that sequence's bound.

    Each projection computes compressed-tensors' function bit for bit on the same input
    (test_activations_are_quantized_as_compressed_tensors_does). The rest of the model (attention over the paged
    cache, rope, norms) rounds apart from transformers' by ~1e-6, and an activation that close to an fp8 rounding
    boundary rounds to the neighbouring value on one side: a step of up to 12% on one element, which moves the
    later log-probabilities of that sequence by up to ~1e-1. Over random prompt sets of this batch's shape about
    one set in two has one such sequence (docs/quantization.md); a wrong scale, a missed quantization or an
    adapter's delta taken on the quantized input moves every sequence by far more than 1e-4."""
    deltas, gaps = [], []
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        sequence = prompt + out.token_ids
        logits = torch.log_softmax(oracle.logits(sequence, name), dim=-1)[len(prompt) - 1 : -1]  # [generated, V]
        top2 = logits.topk(2, dim=-1).values
        gaps.append((top2[:, 0] - top2[:, 1]).tolist())
        deltas.append([abs(entry.logprob - float(logits[step, token]))
                       for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True))])
        bound = 1e-4 if max(deltas[-1]) <= 1e-4 else 0.15
        for step, token in enumerate(out.token_ids):
            assert token == int(logits[step].argmax()) or gaps[-1][step] < 2 * bound, \
                f"adapter {name}, prompt of {len(prompt)}: token {step} is not transformers' top-1"
    apart = {f"adapter {name}, prompt of {len(prompt)}": f"{max(d):.1e}"
             for prompt, name, d in zip(prompts, names, deltas, strict=True) if max(d) > 1e-4}
    print(f"\nin the batch: {len(deltas) - len(apart)} of {len(deltas)} sequences within 1e-4, apart: {apart}; "
          f"smallest top-2 gap {min(min(g) for g in gaps):.1e}")
    assert len(apart) <= max_apart and max(max(d) for d in deltas) < 0.15, f"sequences beyond 1e-4: {apart}"


@pytest.mark.parametrize("case", ["llama-static", "qwen3-dynamic"])
def test_activations_are_quantized_as_compressed_tensors_does(fp8, case):
    """One projection on the same inputs: the engine's fused q/k/v and transformers' q_proj, k_proj and v_proj
    as compressed-tensors runs them (its activation quantization, then the decompressed weight), within float32
    rounding; tokens of very different ranges, so static scales clamp some."""
    from transformers import AutoModelForCausalLM

    _, directory, _, _ = fp8(case)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        reference(torch.tensor([[1, 2]]))  # compressed-tensors decompresses the weights on the first forward
    attention = reference.model.layers[1].self_attn
    engine_qkv = make_llm(directory, {}).engine.runner.model.model.layers[1].self_attn.qkv_proj.base
    gen = torch.Generator().manual_seed(69)
    x = torch.randn(1, 9, 128, generator=gen) * torch.logspace(-2, 1.5, 9)[None, :, None]  # [1, T, hidden]
    with torch.no_grad():
        expected = torch.cat([attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)], dim=-1)[0]
        got = engine_qkv(x[0])
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    unquantized = x[0] @ torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]).t()
    assert (unquantized - expected).abs().max() > 1e-2  # the activations were quantized


@pytest.mark.parametrize("case", ["llama-static", "mixtral-static"])
def test_the_oracle_computes_what_wrote_the_checkpoint(fp8, case):
    """transformers on the checkpoint (with compressed-tensors, its experts' inputs quantized by
    quantize_expert_inputs) against the model that wrote it, compressed-tensors' own quantized Linears (one per
    expert and projection), on a calibration prompt: the same logits within float32 rounding, so the oracle's
    experts are the checkpoint's. Static scales only: with dynamic ones compressed-tensors scales a 2-D input (an
    expert's rows) once over all its rows and a 3-D one per token; the checkpoint says per token, which the
    oracle and the engine do."""
    _, directory, _, oracle = fp8(case)
    probe, expected = torch.load(directory / "producer_logits.pt")
    torch.testing.assert_close(oracle.logits(probe, None), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["llama-block", "qwen3-moe-block", "qwen3-moe-dynamic", "llama-inverse"])
def test_on_the_triton_launchers_matches_peft(fp8, case, triton_launchers):
    """Every op on its Triton launcher: fp8_block_linear for the projections, grouped_matmul for the experts (the
    compressed-tensors ones' rows quantized first); fp8_linear has no launcher and keeps its reference on CPU."""
    arch, directory, adapters, oracle = fp8(case)
    llm = make_llm(directory, adapters)
    assert kernels.backend_for(llm.engine.memory.layers[0]) == "triton"
    prompts, names = _mixed_batch()
    prompts, names = [prompts[i] for i in (0, 3, 2)], [names[i] for i in (0, 3, 2)]  # base, gate/up (experts), q/k/v
    sampling = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, sampling, adapters=names)
    if CASES[case][1] in WEIGHT_ONLY:
        assert_matches_peft(oracle, prompts, names, outputs, 3)
    else:
        assert_matches_peft_with_quantized_activations(oracle, prompts, names, outputs)


@pytest.mark.parametrize("case", ["llama-block", "llama-static", "mixtral-static"])
def test_two_ranks_hold_their_shards_and_match_peft(fp8, case):
    """k_proj and v_proj have 128 rows: each of 2 ranks holds 64, half a 128-row block, with that block's scales
    (blocks), or its rows' share of the per-tensor scale and the static input scales whole (compressed-tensors).

    With quantized activations, the two ranks' partial sums (o_proj, down_proj) add a rounding of their own to the
    ~1e-6 that already puts an activation on the other side of an fp8 boundary now and then, and where it lands
    depends on the CPU's vector width: on one 2-core Xeon two of these four sequences crossed (2.8e-2 and 5.3e-4).
    So half of them may stand apart; a wrong shard, scale or quantization moves all four."""
    arch, directory, adapters, oracle = fp8(case)
    llm = make_llm(directory, adapters, tensor_parallel_size=2)
    try:
        prompts, names = _mixed_batch()
        prompts, names = prompts[:4], names[:4]
        outputs = llm.generate(prompts, SAMPLING, adapters=names)
        if CASES[case][1] in WEIGHT_ONLY:
            assert_matches_peft(oracle, prompts, names, outputs, MAX_TOKENS)
        else:
            assert_matches_peft_with_quantized_activations(oracle, prompts, names, outputs,
                                                           max_apart=len(prompts) // 2)
        qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.base
        assert qkv.out_slices == [128, 64, 64] and qkv.weight.dtype == torch.float8_e4m3fn
    finally:
        llm.engine.shutdown()


def test_memory_counts_fp8_bytes_and_state_reports_the_quantization(fp8):
    arch, directory, adapters, _ = fp8("llama-block")
    llm = make_llm(directory, {})
    split = llm.engine.memory_split()
    model = llm.engine.runner.model
    projections = [m for m in model.modules() if isinstance(m, Fp8BlockLinear)]
    fp8_bytes = sum(m.weight.numel() + m.weight_scale_inv.numel() * 4 for m in projections)
    fp32_bytes = sum(m.weight.numel() * 4 for m in projections)
    assert fp8_bytes < 0.27 * fp32_bytes  # 1 byte a weight, plus a float32 scale per row and 128 columns
    assert split["base_weights_full_precision_bytes"] - split["base_weights_bytes"] == fp32_bytes - fp8_bytes
    assert "fp8" in llm.engine.state()["memory"]["quantization"]


def _rewrite(directory, target, *, config=None, tensors=None):
    """A copy of the checkpoint at `directory` with its config's quantization_config or tensors changed."""
    import shutil

    shutil.copytree(directory, target)
    if config is not None:
        data = json.loads((target / "config.json").read_text())
        data["quantization_config"].update(config)
        (target / "config.json").write_text(json.dumps(data))
    if tensors is not None:
        state = load_file(str(target / "model.safetensors"))
        tensors(state)
        save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


NAME = "model.layers.1.self_attn.k_proj"


@pytest.mark.parametrize(("change", "message"), [
    ({"tensors": lambda s: s.pop(f"{NAME}.weight_scale_inv")}, r"missing weights: .*qkv_proj.weight_scale_inv#1"),
    ({"tensors": lambda s: s.pop("model.layers.0.mlp.down_proj.weight_scale_inv")},
     "'model.layers.0.mlp.down_proj' has fp8 tensors without their 'weight_scale_inv'"),
    ({"tensors": lambda s: s.__setitem__(f"{NAME}.weight_scale_inv", torch.ones(2, 1))},
     r"weight_scale_inv of slice 1 has shape \(2, 1\), expected \(1, 1\)"),
    ({"tensors": lambda s: s.__setitem__(f"{NAME}.weight_scale_inv", torch.zeros(1, 1))}, "not positive and finite"),
    ({"config": {"weight_block_size": [64, 64]}}, r"weight_block_size \[64, 64\] is not served"),
    ({"config": {"weight_block_size": None}}, "without weight_block_size"),
    ({"config": {"activation_scheme": "static"}}, "activation_scheme 'static' is not served"),
    ({"config": {"weight_scale_semantics": "direct"}}, "weight_scale_semantics 'direct' is not served; served: "
                                                       "'inverse'"),
    ({"config": {"weight_scale_method": "row"}}, "weight_scale_method 'row' is not served"),
    ({"config": {"format": "float8_e5m2"}}, "format 'float8_e5m2' is not served; served: e4m3"),
    ({"config": {"scale_fmt": "ue8m0"}}, "scale_fmt 'ue8m0' is not served"),
], ids=["missing-scale-of-a-slice", "missing-scale", "wrong-scale-shape", "zero-scale", "block-64", "no-block",
        "static-activations", "scale-semantics", "scales-per-row", "e5m2", "ue8m0-scales"])
def test_bad_fp8_checkpoints_are_refused_at_start(fp8, tmp_path, change, message):
    _, directory, _, _ = fp8("llama-block")
    with pytest.raises(ValueError, match=message):
        LLM(_rewrite(directory, tmp_path / "bad", **change), device="cpu")


def test_bad_compressed_tensors_fp8_is_refused_at_start(fp8, tmp_path):
    _, directory, _, _ = fp8("llama-static")
    group = json.loads((directory / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    missing = _rewrite(directory, tmp_path / "missing", tensors=lambda s: s.pop(f"{NAME}.input_scale"))
    with pytest.raises(ValueError, match=r"missing weights: .*qkv_proj.input_scale#1"):
        LLM(missing, device="cpu")
    blocks = {"config_groups": {"group_0": {**group, "weights": {**group["weights"], "strategy": "block"}}}}
    with pytest.raises(ValueError, match="weight strategy 'block' is not served; served: tensor, channel"):
        LLM(_rewrite(directory, tmp_path / "block", config=blocks), device="cpu")
    groups = {"config_groups": {"group_0": {**group, "input_activations": {**group["input_activations"],
                                                                           "strategy": "group", "group_size": 128}}}}
    with pytest.raises(ValueError, match="input activations .* are not served"):
        LLM(_rewrite(directory, tmp_path / "group", config=groups), device="cpu")


def test_bad_compressed_tensors_fp8_experts_are_refused_at_start(fp8, tmp_path):
    """An expert's missing input_scale, or gate and up scales that differ (both read the same rows, quantized
    once), are refused at start."""
    _, directory, _, _ = fp8("mixtral-static")
    expert = "model.layers.0.block_sparse_moe.experts.1"
    missing = _rewrite(directory, tmp_path / "missing", tensors=lambda s: s.pop(f"{expert}.w3.input_scale"))
    with pytest.raises(ValueError, match=r"missing weights: .*experts.gate_up_proj_input_scale#3"):
        LLM(missing, device="cpu")

    def halve(state):
        state[f"{expert}.w3.input_scale"] = state[f"{expert}.w3.input_scale"] / 2

    with pytest.raises(ValueError, match=r"experts \[1\] have gate and up input_scale that differ"):
        LLM(_rewrite(directory, tmp_path / "differ", tensors=halve), device="cpu")


def test_a_shard_that_cuts_a_block_of_input_columns_is_refused(fp8):
    """Qwen3-MoE's experts have 128 intermediate columns: 2 ranks would each hold 64 of down_proj's, half a block."""
    _, directory, _, _ = fp8("qwen3-moe-block")
    with pytest.raises(ValueError, match="splits a block of 128 columns that share a scale"):
        LLM(directory, device="cpu", tensor_parallel_size=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["llama-block", "qwen3-moe-block", "llama-static", "qwen3-dynamic",
                                  "qwen3-moe-dynamic", "mixtral-static", "llama-inverse", "qwen3-moe-inverse"])
def test_on_cuda_in_bfloat16_agrees_with_transformers(fp8, case):
    """The CUDA path (fp8_block_linear and grouped_matmul natively, torch._scaled_mm for fp8 activations) in
    bfloat16, against transformers + PEFT in float32: each prompt's log-probabilities within bf16's reach."""
    arch, directory, adapters, oracle = fp8(case)
    llm = LLM(directory, device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=64, max_adapter_rank=16)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    prompts, names = _mixed_batch()
    scoring = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    for prompt, name, out in zip(prompts, names, llm.generate(prompts, scoring, adapters=names), strict=True):
        expected = torch.log_softmax(oracle.logits(prompt, name), dim=-1)
        got = [entry.logprob for entry in (out.prompt_logprobs or [None])[1:]]
        want = [float(expected[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
        assert got == pytest.approx(want, abs=0.15), f"adapter {name}, prompt of {len(prompt)}"


def test_fp8_experts_shards_hold_their_rows_and_scales():
    """Each of 2 ranks holds its half of every expert's gate and up rows and of down's columns, with the scales of
    the blocks those fall in: dequantized, the shards are the whole expert's slices."""
    from engine.models.moe import Experts
    from kernels.fp8_reference import dequantize_fp8_groups

    gen = torch.Generator().manual_seed(70)
    experts, hidden, inter = 2, 200, 256  # hidden not whole blocks; each rank's 128 intermediate columns are

    def stored(rows, cols):
        weight = (torch.randn(rows, cols, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        return weight, torch.rand(-(-rows // 128), -(-cols // 128), generator=gen) + 0.5

    full = {(e, p): stored(*((inter, hidden) if p != "down" else (hidden, inter)))
            for e in range(experts) for p in ("gate", "up", "down")}
    ranks = []
    for rank in range(2):
        with torch.device("meta"):
            base = Experts(experts, hidden, inter // 2, "silu")
        module = Fp8Experts(base, name="experts", tp_rank=rank, tp_size=2).to_empty(device="cpu")
        half = slice(rank * inter // 2, (rank + 1) * inter // 2)
        for e in range(experts):
            for part, p in enumerate(("gate", "up")):
                weight, scale = full[e, p]
                module.load_slice(2 * e + part, "gate_up_proj", weight[half])
                module.load_slice(2 * e + part, "gate_up_proj_scale", scale)
            weight, scale = full[e, "down"]
            module.load_slice(e, "down_proj", weight[:, half])
            module.load_slice(e, "down_proj_scale", scale)
        module.finish()
        ranks.append(module)
    for e in range(experts):
        for part, p in enumerate(("gate", "up")):
            whole = dequantize_fp8_groups(full[e, p][0], full[e, p][1].repeat_interleave(128, 0)[:inter], 128)
            shards = [dequantize_fp8_groups(m.gate_up_proj[e], m.gate_up_proj_scale[e], 128)
                      [part * inter // 2 : (part + 1) * inter // 2] for m in ranks]
            torch.testing.assert_close(torch.cat(shards), whole, rtol=0, atol=0)
        whole = dequantize_fp8_groups(full[e, "down"][0], full[e, "down"][1].repeat_interleave(128, 0)[:hidden], 128)
        shards = [dequantize_fp8_groups(m.down_proj[e], m.down_proj_scale[e], 128) for m in ranks]
        torch.testing.assert_close(torch.cat(shards, dim=1), whole, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"weight_scale_inv of gate_up_proj has shape \(1, 1\), expected \(2, 2\)"):
        ranks[0].load_slice(0, "gate_up_proj_scale", torch.ones(1, 1))
