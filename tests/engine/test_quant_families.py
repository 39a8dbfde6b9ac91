"""Pre-quantized checkpoints on every dense family beyond Llama and Qwen, and at the group sizes real
checkpoints use: Phi-3 with its fused qkv_proj / gate_up_proj stored as one packed tensor each (GPTQ, AWQ,
compressed-tensors, and fp8 128 x 128 blocks), Mistral, Gemma 2 and Gemma 3 in an integer format each, and GPTQ with
act order at group 64 and 128 and compressed-tensors W4A16 at group 128 on a model wide enough for them.

Oracle as in tests/engine/test_quant_formats.py: transformers + PEFT on the dequantized twin (fp8: transformers
dequantizing the same files), greedy tokens identical and log-probabilities within 1e-4 in one mixed batch of base
and adapter requests."""

import json

import pytest
import torch
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from tests.engine.conftest import build_adapter, build_checkpoint, random_prompts
from tests.engine.fp8_checkpoints import block_oracle, build_base, write_block_fp8
from tests.engine.quantized_checkpoints import write_quantized
from tests.engine.test_families import assert_matches_peft
from tests.engine.test_phi3 import fused_equivalent, split_adapter
from tests.engine.test_quant_formats import ALL, CASES, _load, _rewrite, check_against_oracle

FUSED_NAMES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # what PEFT targets on Phi-3's checkpoint
PHI3_NAMES = ("fused8", None, "split", "fused8", "qv-fused")


@pytest.fixture(scope="module")
def phi3_adapters(checkpoints, tmp_path_factory):
    """(what the engine loads, what PEFT runs on the fused checkpoint): fused-name adapters, and one with split
    names (q_proj ... up_proj, from a "llamafied" Phi-3) whose PEFT twin is its fused equivalent."""
    root, base = tmp_path_factory.mktemp("phi3-quant-adapters"), checkpoints["phi3"]
    config = json.loads((base / "config.json").read_text())
    split = split_adapter(base, root / "split", seed=52, r=4, targets=ALL, rank_pattern={"k_proj": 2})
    engine = {"fused8": build_adapter(base, root / "fused8", seed=50, r=8, targets=FUSED_NAMES),
              "qv-fused": build_adapter(base, root / "qv-fused", seed=51, r=4, targets=["qkv_proj"]),
              "split": split}
    return engine, {**engine, "split": fused_equivalent(split, root / "split-as-fused", config)}


@pytest.mark.parametrize("case", ["gptq-v1-w4-g32-asym-act-order", "awq-w4-g32", "ct-pack-w4a16-g32-asym",
                                  "ct-naive-int8-channel"])
def test_phi3_fused_projections_stored_packed_match_peft(checkpoints, phi3_adapters, tmp_path, case):
    """One packed tensor per fused projection (one g_idx, one set of groups over q, k and v together), served as
    one quantized linear whose output is split into the slices LoRA adds to."""
    model_dir, dequantized = write_quantized(checkpoints["phi3"], tmp_path / case, seed=3, **CASES[case])
    engine, oracle = phi3_adapters
    llm = check_against_oracle(model_dir, dequantized, engine, oracle_adapters=oracle, names=PHI3_NAMES)
    layer = llm.engine.runner.model.model.layers[0]
    for fused in (layer.self_attn.qkv_proj.base, layer.mlp.gate_up_proj.base):
        assert fused.qweight.dtype == torch.int32 and len(fused.out_slices) > 1


def test_phi3_packed_on_the_triton_launchers_matches_peft(checkpoints, phi3_adapters, tmp_path, triton_launchers):
    model_dir, dequantized = write_quantized(checkpoints["phi3"], tmp_path / "awq", seed=3, **CASES["awq-w4-g32"])
    engine, oracle = phi3_adapters
    check_against_oracle(model_dir, dequantized, engine, oracle_adapters=oracle, lengths=(3, 9, 1),
                         names=("fused8", None, "split"), max_tokens=3)


def test_phi3_packed_over_two_tensor_parallel_ranks_matches_peft(checkpoints, phi3_adapters, tmp_path):
    """Each rank reads the fused tensors whole and keeps its share of each slice: q's, k's and v's columns."""
    case = "gptq-v1-w4-g32-asym-act-order"
    model_dir, dequantized = write_quantized(checkpoints["phi3"], tmp_path / case, seed=3, **CASES[case])
    engine, oracle = phi3_adapters
    check_against_oracle(model_dir, dequantized, engine, oracle_adapters=oracle, lengths=(3, 14, 9),
                         names=("fused8", None, "split"), max_tokens=4, tensor_parallel_size=2)


def test_a_fused_packed_tensor_of_the_wrong_width_is_refused(checkpoints, tmp_path):
    model_dir, _ = write_quantized(checkpoints["phi3"], tmp_path / "awq", seed=3, **CASES["awq-w4-g32"])
    name = "model.layers.0.self_attn.qkv_proj.qweight"
    qweight = load_file(str(model_dir / "model.safetensors"))[name]
    bad = _rewrite(model_dir, tmp_path, tensors={name: qweight[:, :-1].contiguous()})
    with pytest.raises(ValueError, match=r"qkv_proj: fused qweight has shape \(64, 15\).* needs 16 along dim 1"):
        _load(bad)


@pytest.mark.parametrize(("arch", "case"), [("mistral", "gptq-v2-w4-g32-asym-act-order"), ("gemma2", "awq-w4-g32"),
                                          ("gemma3", "ct-pack-w4a16-g32-asym")])
def test_other_families_match_peft(checkpoints, tmp_path, arch, case):
    """Mistral (tied embeddings, a two-file checkpoint), Gemma 2 (soft-caps, GELU, windows) and Gemma 3 (q/k norms,
    a local and a global rope) with their projections packed."""
    model_dir, dequantized = write_quantized(checkpoints[arch], tmp_path / case, seed=3, **CASES[case])
    adapters = {"all8": build_adapter(checkpoints[arch], tmp_path / "all8", seed=53, r=8, targets=ALL)}
    check_against_oracle(model_dir, dequantized, adapters, lengths=(3, 14, 9), names=("all8", None, "all8"))


WIDE_CASES = {  # group sizes of the published checkpoints (Qwen2.5-*-GPTQ-Int4: 128), with act order
    "gptq-w4-g64-asym-act-order": dict(fmt="gptq", bits=4, group_size=64, sym=False, act_order=True),
    "gptq-v2-w4-g128-sym-act-order": dict(fmt="gptq_v2", bits=4, group_size=128, sym=True, act_order=True),
    "ct-pack-w4a16-g128-asym": dict(fmt="pack", bits=4, group_size=128, sym=False),
    "awq-w4-g64": dict(fmt="awq", bits=4, group_size=64, sym=False),
}


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A Llama wide enough for groups of 128 (hidden 128, intermediate 256: down_proj two groups), and adapters."""
    root = tmp_path_factory.mktemp("wide")
    base = build_checkpoint(root / "base", "llama", seed=11, hidden_size=128, intermediate_size=256,
                            initializer_range=0.1)
    adapters = {"all8": build_adapter(base, root / "all8", seed=54, r=8, targets=ALL),
                "qv4": build_adapter(base, root / "qv4", seed=55, r=4, targets=["q_proj", "v_proj"])}
    return base, adapters


@pytest.mark.parametrize("case", list(WIDE_CASES))
def test_group_sizes_64_and_128_match_peft(wide, tmp_path, case):
    base, adapters = wide
    settings = WIDE_CASES[case]
    model_dir, dequantized = write_quantized(base, tmp_path / case, seed=3, **settings)
    llm = check_against_oracle(model_dir, dequantized, adapters, lengths=(3, 14, 9), names=("all8", None, "qv4"))
    down = llm.engine.runner.model.model.layers[0].mlp.down_proj.base
    assert down.scales.shape[0] == 256 // settings["group_size"]  # served at the checkpoint's groups
    assert (down.perm is not None) == settings.get("act_order", False)
    # what /v1/state says the weights take (and the pool is left after): the checkpoint's packed tensors (the
    # engine holds one g_idx per fused projection, and with act order the sorting permutation)
    memory = llm.engine.state()["memory"]
    stored = sum(t.numel() * t.element_size() for t in load_file(str(model_dir / "model.safetensors")).values())
    assert memory["base_weights_bytes"] == pytest.approx(stored, rel=0.03)
    assert memory["quantization"].endswith(f"g{settings['group_size']} {'sym' if settings['sym'] else 'asym'}"
                                           f"{' act-order' if settings.get('act_order') else ''}")


def test_phi3_fp8_blocks_on_fused_projections_match_peft(tmp_path):
    """Phi-3 as an `fp8` 128 x 128 block checkpoint written by transformers' own quantizer: qkv_proj and
    gate_up_proj are each one fp8 weight with one grid of block scales over every slice; transformers dequantizes
    the same files as the oracle."""
    rotary = 32 * 3 // 4 // 2  # head_dim 32, partial rotary 0.75: factors per rotated pair
    # q 128 rows, k and v 64 each: the second block of 128 rows holds k and v, so its scale is both slices'
    base = build_base(tmp_path / "base", "phi3", seed=56, head_dim=32, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0 + i / rotary for i in range(rotary)],
        "long_factor": [2.0 + i / rotary for i in range(rotary)]})
    model_dir = write_block_fp8(base, tmp_path / "fp8")
    adapters = {"fused8": build_adapter(base, tmp_path / "fused8", seed=57, r=8, targets=FUSED_NAMES),
                "qkv4": build_adapter(base, tmp_path / "qkv4", seed=58, r=4, targets=["qkv_proj"])}
    llm = LLM(model_dir, device="cpu", max_num_seqs=8, num_kv_blocks=128, block_size=4)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.base
    assert type(qkv).__name__ == "Fp8BlockLinear" and qkv.weight.dtype == torch.float8_e4m3fn
    prompts, names = random_prompts(59, [3, 14, 9, 6]), ["fused8", None, "qkv4", "fused8"]
    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, sampling, adapters=names)
    assert_matches_peft(block_oracle(model_dir, adapters), prompts, names, outputs, max_tokens=6)


def _one_wide_layer(tmp_path, case):
    """One layer of Llama-3-8B's attention widths (hidden 4096, intermediate 4096), stored as `case`."""
    base = build_checkpoint(tmp_path / "base", "llama", seed=12, num_layers=1, hidden_size=4096,
                            intermediate_size=4096, num_attention_heads=32, num_key_value_heads=8,
                            initializer_range=0.02)
    return write_quantized(base, tmp_path / case, seed=3, **CASES[case])[0]


def _pool_sizing_bound(model) -> float:
    """The packed weights (about 50 MiB), and a margin for the allocator's partly used segments."""
    from engine.quantization.on_load import tensor_bytes

    return tensor_bytes(model) * 1.25 + (64 << 20)


@pytest.mark.parametrize("case", ["awq-w4-g32", "gptq-v1-w4-g32-asym-act-order"])
def test_on_a_caching_allocator_the_load_leaves_the_packed_weights_alone(tmp_path, monkeypatch, case):
    """The CUDA check below, told on CPU: the load's device allocations (tests/engine/caching_allocator.py) through
    a model of CUDA's caching allocator. Repacking (AWQ) and sorting act order unpack the words into int32 and
    int64 scratch of 8 to 16 times the packed size; kernel tensors made after that scratch is freed are cut from
    its cached blocks and keep those segments from the device (cut so, this model holds 170 MiB of segments for
    53.5 MiB of tensors; the H200 measured 162 MiB)."""
    from engine.models import loader, prequantized
    from engine.models.causal_lm import CausalLM
    from tests.engine.caching_allocator import HOST, RELEASE, marked, replay

    model_dir, held = _one_wide_layer(tmp_path, case), []

    def load():
        held.append(loader.load_model(model_dir, dtype=torch.bfloat16, device=torch.device("cpu")))
        return [*held[0].parameters(), *held[0].buffers(), held[0].cos_sin_cache]

    # reading the checkpoint is host work on CUDA; the loader's release_cache is CUDA's empty_cache
    with (marked(monkeypatch, CausalLM, "load_weights", HOST),
          marked(monkeypatch, prequantized, "_stored_kinds", HOST),
          marked(monkeypatch, loader, "release_cache", RELEASE)):
        allocator = replay(load, tmp_path / "trace.json")
    assert allocator.reserved() <= _pool_sizing_bound(held[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_pool_is_sized_after_the_packed_weights_alone(tmp_path):
    """The page pool is a share of the memory free once the weights are in. Turning AWQ's stored tensors into
    the kernel's layout frees them into torch's cache, which the device still counts as used: the loader hands
    that back, so the weights the budget is left after are the packed ones (not those plus their stored copies:
    about twice as much, and more with the unpacking's scratch, whose segments a kernel tensor made after it
    would keep: IntLinear.finish makes those first). One layer of Llama-3-8B's attention widths."""
    from engine.models import load_model

    model_dir = _one_wide_layer(tmp_path, "awq-w4-g32")
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    model = load_model(model_dir, dtype=torch.bfloat16, device=torch.device("cuda"))
    used = free_before - torch.cuda.mem_get_info()[0]
    assert used <= _pool_sizing_bound(model)
