"""Pre-quantized checkpoints (issue 36): GPTQ (v1, v2, act order, 4 and 8 bits), AWQ (gemm) and compressed-tensors
(pack-quantized W4A16 / W8A16, naive-quantized int8), loaded as stored and served with LoRA on top.

Oracle: transformers + PEFT on the dequantized twin of each checkpoint (tests/engine/quantized_checkpoints.py:
W = (q - z) * s from the integers before packing; for compressed-tensors, the package's own decompression).
transformers itself does not load these on CPU: GPTQ and AWQ need gptqmodel / autoawq and their CUDA kernels,
and its compressed-tensors path rejects packed zero points of asymmetric schemes (a size mismatch at load)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.models import load_model
from engine.quant_formats import FORMATS, read_quant_spec
from tests.engine.conftest import Oracle, build_adapter, random_prompts
from tests.engine.quantized_checkpoints import write_quantized

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
    """name -> (quantized checkpoint, dequantized twin), written once per module."""
    root, made = tmp_path_factory.mktemp("quantized"), {}

    def get(name: str):
        if name not in made:
            made[name] = write_quantized(checkpoints["llama"], root / name, seed=3, **CASES[name])
        return made[name]
    return get


def check_against_oracle(model_dir, dequantized, adapters, *, lengths=(3, 14, 9, 1, 11), names=NAMES,
                         max_tokens: int = 6) -> LLM:
    """Greedy tokens identical and prompt log-probabilities within 1e-4 of transformers + PEFT on the dequantized
    twin, for base and adapter requests in one batch."""
    oracle = Oracle(dequantized, adapters)
    llm = LLM(model_dir, device="cpu", max_num_seqs=8, num_kv_blocks=128, block_size=4)
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
    assert llm.engine.memory_split()["quantization"].startswith(case.split("-")[0].replace("ct", "compressed-tensors"))


def test_engine_on_the_triton_launchers_matches_peft(quantized, llama_adapters, triton_launchers):
    """The GEMM every integer format is served by (after repacking: AWQ and compressed-tensors reach it in the same
    layout), with act order and zero points, under Triton's interpreter with every other op on its launcher."""
    check_against_oracle(*quantized("gptq-v2-w4-g32-asym-act-order"), llama_adapters, lengths=(3, 9, 1),
                         names=("all8", None, "mlp16"), max_tokens=3)


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
