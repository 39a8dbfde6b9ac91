"""Quantized base weights (int8, fp8) and the fp8 KV cache under full-precision LoRA.

The engine is checked two ways: against transformers + PEFT applied to the dequantized int8 base (the
same function up to float rounding), and against the unquantized engine over 2,000 generated tokens with
mixed adapters (top-1 agreement and mean |delta log-probability|, printed; benchmarks/RESULTS.md has them).
Agreement is asserted on the tiny llama checkpoint trained briefly (benchmarks.quantization.train_peaked):
the random checkpoint's next-token distributions are so flat that 4% of its greedy positions have their
top two tokens within 0.02 nats, where any perturbation flips the choice (docs/quantization.md)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.quantization import CONFIGS, agreement, train_peaked
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.models import load_model
from engine.models.loader import quantize_model
from engine.quantization.on_load import QuantizedLinear, dequantize, quantize_int8, tensor_bytes
from tests.engine.conftest import Oracle, build_adapter, build_tokenizer, random_prompts

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
MAX_MEAN_DLOGPROB = {"int8": 0.01, "fp8": 0.04, "kv-fp8": 0.01, "fp8+kv-fp8": 0.04}


@pytest.fixture(scope="module")
def adapters(checkpoints, tmp_path_factory):
    root, base = tmp_path_factory.mktemp("quant-adapters"), checkpoints["llama"]
    return {
        "all8": build_adapter(base, root / "all8", seed=20, r=8, targets=ALL),
        "qv4": build_adapter(base, root / "qv4", seed=21, r=4, targets=["q_proj", "v_proj"]),
        "mlp16": build_adapter(base, root / "mlp16", seed=22, r=16, targets=["gate_proj", "up_proj", "down_proj"]),
    }


def make_llm(model_dir, adapters, **config) -> LLM:
    llm = LLM(model_dir, device="cpu", max_num_seqs=40, num_kv_blocks=256, **config)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return llm


@pytest.fixture(scope="module")
def peaked(checkpoints, tmp_path_factory):
    """The llama checkpoint trained on a bigram chain, and three adapters of it."""
    root = tmp_path_factory.mktemp("quant-peaked")
    base = train_peaked(checkpoints["llama"], root / "base")
    return base, {
        "all8": build_adapter(base, root / "all8", seed=30, r=8, targets=ALL),
        "qv4": build_adapter(base, root / "qv4", seed=31, r=4, targets=["q_proj", "v_proj"]),
        "mlp16": build_adapter(base, root / "mlp16", seed=32, r=16, targets=["gate_proj", "up_proj", "down_proj"]),
    }


@pytest.fixture(scope="module")
def reference(peaked):
    return make_llm(*peaked)


def _projections(model):
    return [getattr(parent, name) for layer in model.model.layers for parent in (layer.self_attn, layer.mlp)
            for name in PROJECTIONS if hasattr(parent, name)]


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_projections_take_under_0_3_of_fp32(checkpoints, method):
    model = load_model(checkpoints["llama"], dtype=torch.float32, device=torch.device("cpu"))
    full = sum(tensor_bytes(p) for p in _projections(model))
    quantize_model(model, method)
    projections = _projections(model)
    assert all(isinstance(p, QuantizedLinear) for p in projections) and len(projections) == 8
    quantized = sum(tensor_bytes(p) for p in projections)
    print(f"\n{method}: projections {quantized} bytes / fp32 {full} bytes = {quantized / full:.3f}")
    assert quantized <= 0.3 * full


def test_int8_quantizer_rounds_each_weight_to_its_nearest_step():
    weight = torch.randn(48, 40) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different ranges
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and torch.allclose(scale, weight.abs().amax(1) / 127)
    assert ((dequantize(q, scale) - weight).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.fixture(scope="module")
def dequantized_int8_checkpoint(checkpoints, tmp_path_factory):
    """The llama checkpoint with every decoder projection replaced by its int8 dequantization."""
    model = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.float32)
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in ALL:
            module.weight.data = dequantize(*quantize_int8(module.weight.data))
    directory = tmp_path_factory.mktemp("dequantized") / "llama-int8"
    model.save_pretrained(directory)
    build_tokenizer(directory)
    return directory


def test_int8_engine_matches_peft_on_the_dequantized_base(checkpoints, adapters, dequantized_int8_checkpoint):
    oracle = Oracle(dequantized_int8_checkpoint, adapters)
    llm = make_llm(checkpoints["llama"], adapters, quantization="int8", block_size=4)
    names = ["all8", None, "qv4", "mlp16", "all8", "mlp16"]
    prompts = random_prompts(5, [3, 17, 9, 1, 12, 25])
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate(prompts, greedy, adapters=names)
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        assert out.token_ids == oracle.greedy(prompt, name, 8), f"adapter {name}"
        expected = torch.log_softmax(oracle.logits(prompt, name), -1)
        got = [lp.logprob for lp in (out.prompt_logprobs or [None])[1:]]
        want = [float(expected[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
        assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_agreement_with_the_unquantized_engine_over_2000_tokens(peaked, reference, config):
    quantization, kv_cache_dtype = CONFIGS[config]
    llm = make_llm(*peaked, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    prompts = random_prompts(7, [4 + (i * 7) % 29 for i in range(40)])
    names = [[None, "all8", "qv4", "mlp16"][i % 4] for i in range(40)]
    result = agreement(reference, llm, prompts, names, max_tokens=50)
    print(f"\n{config}: top-1 agreement {result['agreement']:.2%} over {result['tokens']} tokens, "
          f"mean |dlogprob| {result['mean_abs_dlogprob']:.5f}, max {result['max_abs_dlogprob']:.4f}; "
          f"{result['decisive_agreement']:.2%} of {result['decisive_tokens']} decisive positions")
    assert result["tokens"] == 2000
    assert result["agreement"] >= 0.98
    # the size of the error each scheme makes (int8 ~0.5% per weight, fp8 ~3.7% per product, fp8 KV ~3% per
    # value, measured 0.002-0.013): a wrong scale or a misplaced page shows as a larger mean
    assert 0 < result["mean_abs_dlogprob"] < MAX_MEAN_DLOGPROB[config]


def test_fp8_kv_cache_holds_more_tokens_in_the_same_pool(peaked, reference):
    llm = make_llm(*peaked, kv_cache_dtype="fp8", quantization="int8")
    split, full = llm.engine.memory_split(), reference.engine.memory_split()
    # fp32 K and V of head_dim 16: 64 bytes; fp8: 16 bytes and a float32 scale
    assert split["kv_bytes_per_token"] == full["kv_bytes_per_token"] * (16 + 4) / 64
    assert split["kv_bytes_per_token_full_precision"] == full["kv_bytes_per_token"]
    assert split["kv_capacity_tokens"] == split["pages_total"] * 16
    assert split["kv_capacity_tokens"] > 3 * split["kv_capacity_tokens_full_precision"]
    assert split["base_weights_bytes"] < full["base_weights_bytes"] == split["base_weights_full_precision_bytes"]
    assert split["quantization"] == "int8" and split["kv_cache_dtype"] == "float8_e4m3fn"
    assert llm.engine.state()["memory"]["kv_capacity_tokens"] == split["kv_capacity_tokens"]  # /v1/state
    k_cache, _ = llm.engine.memory.kv_cache(0)
    assert k_cache.dtype == torch.float8_e4m3fn
    assert llm.engine.memory.flat(0).dtype == torch.float32  # adapter rows stay in the activation dtype


@pytest.mark.parametrize(("field", "value", "message"), [
    ("quantization", "int4", "quantization must be one of"),
    ("kv_cache_dtype", "int8", "kv_cache_dtype must be one of"),
])
def test_bad_quantization_settings_are_refused(checkpoints, field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(checkpoints["llama"]), **{field: value})
    assert EngineConfig(model=str(checkpoints["llama"]), quantization="none").quantization is None


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
def test_fp8_linear_launcher_matches_the_reference_on_the_same_input(device):
    """kernels/fp8_linear.py (torch._scaled_mm, which this CPU's torch runs too) against the reference, both given
    the same bfloat16 x. Each quantizes x per token into fp8; the reference given x in float32 instead (as this
    test did) rounds another input: bf16 moves each element by up to 2**-9 of itself, which moves its token's
    scale and sends an element near an fp8 rounding midpoint to the neighbouring fp8 value, a step of 1/8 of its
    binade. Summed over 256 columns those steps made 0.0535 at (4, 22) on the H200, and make the same 0.0535 at
    (4, 22) here on CPU. On the same input the two compute the same float32 products and round once to bf16."""
    from engine.quantization.on_load import quantize_fp8
    from kernels import reference
    from kernels.fp8_linear import fp8_linear

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 256, generator=gen).bfloat16()
    weight, scale = quantize_fp8(torch.randn(96, 256, generator=gen) * 0.05)
    expected = reference.fp8_linear(x, weight, scale)  # [37, 96] bf16
    try:
        got = fp8_linear(x.to(device), weight.to(device), scale.to(device))
    except (NotImplementedError, RuntimeError) as error:
        if device != "cpu":
            raise
        pytest.skip(f"this torch has no CPU torch._scaled_mm: {error}")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_agreement_on_cuda_in_bfloat16(peaked, config):
    """The CUDA paths (torch._scaled_mm, the Triton kernels on fp8 pages) against the unquantized bf16 engine."""
    quantization, kv_cache_dtype = CONFIGS[config]
    base, names = peaked

    def cuda_llm(**fields):
        llm = LLM(base, device="cuda", dtype="bfloat16", max_num_seqs=40, num_kv_blocks=256, **fields)
        for name, path in names.items():
            llm.add_adapter(name, path)
        return llm

    prompts = random_prompts(7, [4 + (i * 7) % 29 for i in range(40)])
    adapters = [[None, "all8", "qv4", "mlp16"][i % 4] for i in range(40)]
    result = agreement(cuda_llm(), cuda_llm(quantization=quantization, kv_cache_dtype=kv_cache_dtype), prompts,
                       adapters, max_tokens=50)
    print(f"\ncuda {config}: top-1 agreement {result['agreement']:.2%}, "
          f"mean |dlogprob| {result['mean_abs_dlogprob']:.4f}")
    assert result["agreement"] >= 0.98
