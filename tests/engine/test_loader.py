"""Loading quantizes each projection as soon as its weights are read (engine/models/loader.py): the most
parameter bytes alive during the load stay near the quantized model's, far under the unquantized model's,
and the weights are those of quantizing the loaded full-precision model."""

import pytest
import torch

from engine.models import CausalLM, load_model
from engine.models.loader import quantize_model
from engine.quantization.on_load import QuantizedLinear, tensor_bytes, unquantized_bytes

CPU = torch.device("cpu")


def _allocated_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers that have memory (those still on the meta device have none)."""
    held = {t.data_ptr(): t.numel() * t.element_size()
            for t in [*model.parameters(), *model.buffers()] if not t.is_meta}
    return sum(held.values())


def _load_measuring_peak(monkeypatch, model_dir, quantization):
    """The model, and the most bytes its tensors held at once, measured after every checkpoint tensor is
    copied in (before the loader goes on to the next one)."""
    peak = 0
    load_weights = CausalLM.load_weights

    def measured(self, weights):
        nonlocal peak

        def each():
            nonlocal peak
            for item in weights:
                yield item
                peak = max(peak, _allocated_bytes(self))
        load_weights(self, each())
        peak = max(peak, _allocated_bytes(self))

    monkeypatch.setattr(CausalLM, "load_weights", measured)
    model = load_model(model_dir, dtype=torch.float32, device=CPU, quantization=quantization)
    return model, peak


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])  # mistral: several safetensors files
def test_the_loading_peak_is_the_quantized_model_plus_the_projections_being_read(checkpoints, monkeypatch, name):
    model, peak = _load_measuring_peak(monkeypatch, checkpoints[name], "int8")
    quantized, full = tensor_bytes(model), unquantized_bytes(model)
    largest = max(m.qweight.numel() * 4 for m in model.modules() if isinstance(m, QuantizedLinear))
    print(f"\n{name}: load peak {peak} bytes; quantized model {quantized}, unquantized {full}, "
          f"largest fp32 projection {largest}")
    assert peak <= quantized + 2 * largest  # at most two projections in full precision at once (q/k/v and o)
    assert peak < 0.75 * full


def test_an_unquantized_load_peaks_at_the_full_model(checkpoints, monkeypatch):
    model, peak = _load_measuring_peak(monkeypatch, checkpoints["llama"], None)
    assert peak == tensor_bytes(model) == unquantized_bytes(model)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantizing_while_loading_gives_the_weights_of_quantizing_after(checkpoints, method):
    after = load_model(checkpoints["qwen2"], dtype=torch.float32, device=CPU)
    quantize_model(after, method)
    during = load_model(checkpoints["qwen2"], dtype=torch.float32, device=CPU, quantization=method)
    a, b = after.state_dict(), during.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key].float(), b[key].float()), key
    assert torch.equal(after.cos_sin_cache, during.cos_sin_cache)
    assert sum(isinstance(m, QuantizedLinear) for m in during.modules()) == 8
    assert not any(t.is_meta for t in [*during.parameters(), *during.buffers()])


def test_w4a16_group_128_projections_take_under_0_3_of_bf16(tmp_path, monkeypatch):
    """A GPTQ 4-bit checkpoint at group size 128 loads as stored: its projections' bytes (packed
    weights, fp16 scales, packed zeros, g_idx) against the same projections in bf16, and the loading peak is the
    packed model (no projection is ever materialised in full precision)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.quantization import PackedLinear
    from tests.engine.conftest import build_tokenizer
    from tests.engine.quantized_checkpoints import write_quantized

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=160, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    build_tokenizer(tmp_path / "base")
    model_dir, _ = write_quantized(tmp_path / "base", tmp_path / "gptq", fmt="gptq", bits=4, group_size=128,
                                   act_order=True)
    full = load_model(tmp_path / "base", dtype=torch.bfloat16, device=CPU)
    full_bytes = sum(m.weight.numel() * 2 for n, m in full.named_modules() if n.endswith(("qkv_proj", "o_proj",
                                                                                          "gate_up_proj", "down_proj")))
    model, peak = _load_measuring_peak(monkeypatch, model_dir, None)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    packed_bytes = sum(tensor_bytes(m) for m in packed)
    print(f"\nW4A16 g128: projections {packed_bytes} bytes / bf16 {full_bytes} bytes = {packed_bytes / full_bytes:.3f}")
    assert len(packed) == 8 and packed_bytes <= 0.30 * full_bytes
    assert peak <= tensor_bytes(model) * 1.05  # the stored tensors, then their kernel layout, one projection at a time
