"""Every served family's projections, Phi-3's two naming styles, and the refusal of a module a family lacks."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from adapters import AdapterError, load_adapter
from tests.adapters.builders import (
    TINY,
    gemma2_config,
    gemma3_text_config,
    llama_config,
    lora_config,
    mistral_config,
    phi3_config,
    qwen2_config,
    qwen3_config,
    write_adapter,
)

SPLIT = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def split_phi3_adapter(directory, **lora):
    """What PEFT writes for a Phi-3 whose q/k/v and gate/up were split into Llama's modules (a "llamafied"
    Phi-3): the split names, at Phi-3's widths."""
    torch.manual_seed(0)
    llamafied = LlamaForCausalLM(LlamaConfig(**TINY))
    get_peft_model(llamafied, LoraConfig(init_lora_weights=False, **lora)).save_pretrained(directory)
    return directory


def test_a_split_name_adapter_loads_on_phi3_with_its_own_ranks(tmp_path):
    directory = split_phi3_adapter(tmp_path / "split", r=4, lora_alpha=8, target_modules=SPLIT,
                                   rank_pattern={"k_proj": 2})  # fmt: skip
    adapter = load_adapter(directory, phi3_config().to_dict())
    assert set(adapter.ranks) == {f"layers.{i}.{m}" for i in range(2) for m in SPLIT}
    assert adapter.ranks["layers.0.k_proj"] == 2 and adapter.ranks["layers.1.q_proj"] == 4
    assert adapter.tensors["layers.0.v_proj.lora_B"].shape == (32, 4)  # 2 kv heads of 16
    assert adapter.target_modules == SPLIT


def test_a_pattern_matching_fused_and_split_names_takes_the_fused_as_peft_on_phi3_would(tmp_path):
    """`.*_proj` on the real Phi-3 wraps qkv_proj, o_proj, gate_up_proj and down_proj; the split aliases stay out."""
    from peft import get_peft_model as wrap
    from transformers import Phi3ForCausalLM

    torch.manual_seed(0)
    peft_model = wrap(Phi3ForCausalLM(phi3_config()), LoraConfig(r=2, target_modules=r".*_proj", init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "fused")
    adapter = load_adapter(tmp_path / "fused", phi3_config().to_dict())
    assert adapter.target_modules == ["o_proj", "down_proj", "qkv_proj", "gate_up_proj"]


FAMILIES = {
    "llama": (llama_config, "qkv_proj", "a Llama base (LlamaForCausalLM)"),
    "mistral": (mistral_config, "gate_up_proj", "a Mistral base (MistralForCausalLM)"),
    "qwen2": (qwen2_config, "c_attn", "a Qwen2 base (Qwen2ForCausalLM)"),
    "qwen3": (qwen3_config, "qkv_proj", "a Qwen3 base (Qwen3ForCausalLM)"),
    "gemma2": (gemma2_config, "dense", "a Gemma 2 base (Gemma2ForCausalLM)"),
    "gemma3": (gemma3_text_config, "gate_up_proj", "a Gemma 3 base (Gemma3ForCausalLM)"),
    "phi3": (phi3_config, "dense", "a Phi-3 base (Phi3ForCausalLM)"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_target_module_the_family_lacks_is_refused_naming_both(tmp_path, family):
    config_factory, missing, named = FAMILIES[family]
    directory = write_adapter(tmp_path / "a", config=lora_config(target_modules=["o_proj", missing]),
                              tensors={})  # fmt: skip
    with pytest.raises(AdapterError) as refused:
        load_adapter(directory, config_factory().to_dict())
    assert refused.value.code == "unsupported_module"
    assert f"target_modules names {missing}, which {named} does not have" in refused.value.message


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_a_fused_name_tensor_on_a_split_family_is_refused_naming_both(tmp_path, family):
    config_factory, _, named = FAMILIES[family]
    name = "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight"
    directory = write_adapter(tmp_path / "a", config=lora_config(target_modules=".*q_proj"),
                              tensors={name: torch.ones(4, 64)})  # fmt: skip
    with pytest.raises(AdapterError) as refused:
        load_adapter(directory, config_factory().to_dict())
    assert refused.value.code == "unsupported_module"
    assert f"adapts qkv_proj, which {named} does not have" in refused.value.message


def test_fused_and_split_names_of_one_layer_are_refused_on_phi3(tmp_path):
    directory = split_phi3_adapter(tmp_path / "split", r=4, target_modules=["q_proj", "v_proj"])
    from safetensors.torch import load_file, save_file

    weights = directory / "adapter_model.safetensors"
    tensors = load_file(weights)
    prefix = "base_model.model.model.layers.0.self_attn.qkv_proj"
    tensors |= {f"{prefix}.lora_A.weight": torch.ones(4, 64), f"{prefix}.lora_B.weight": torch.ones(128, 4)}
    save_file(tensors, weights)
    config = (directory / "adapter_config.json").read_text().replace('"q_proj"', '"q_proj", "qkv_proj"')
    (directory / "adapter_config.json").write_text(config)
    with pytest.raises(AdapterError) as refused:
        load_adapter(directory, phi3_config().to_dict())
    assert refused.value.code == "module_conflict"
    assert "layer 0 q_proj" in refused.value.message and "fused qkv_proj" in refused.value.message
