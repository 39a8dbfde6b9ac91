"""LoRA on the MoE experts as PEFT makes it (transformers 5: the experts are stacked parameters; PEFT's
target_parameters gives each expert its own A and B, stacked along the rank): read, checked against the base,
saved in the canonical form that PEFT reads back, and refused clearly where Quilt cannot serve it."""

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from adapters import AdapterError, BaseShapes, load_adapter, load_canonical
from tests.adapters.builders import TINY, llama_config

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def moe_config() -> Qwen3MoeConfig:  # 5 experts of 40, layer 1 dense (mlp_only_layers)
    return Qwen3MoeConfig(**{**TINY, "num_hidden_layers": 3}, num_experts=5, num_experts_per_tok=2,
                          moe_intermediate_size=40, mlp_only_layers=[1])


def make(directory, **lora) -> tuple[object, dict]:
    torch.manual_seed(0)
    config = moe_config()
    model = get_peft_model(Qwen3MoeForCausalLM(config), LoraConfig(**lora))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param)
    model.save_pretrained(directory)
    return model, config.to_dict()


def lora_layers(model) -> dict:
    return {name: m for name, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}


@pytest.mark.parametrize("lora,ranks", [
    (dict(r=2, target_modules=[], target_parameters=["mlp.gate.weight"]), {"router": 2}),
    (dict(r=4, target_modules=[], target_parameters=EXPERTS), {"experts_gate_up_proj": 4, "experts_down_proj": 4}),
    # PEFT turns the projections' names into target_parameters, gate_up at twice the rank (gate's and up's)
    (dict(r=2, target_modules=["gate_proj", "up_proj", "down_proj"]),
     {"experts_gate_up_proj": 4, "experts_down_proj": 2}),
    (dict(r=3, target_modules=["q_proj"], target_parameters=["down_proj"]), {"q_proj": 3, "experts_down_proj": 3}),
], ids=["router", "target-parameters", "projection-names", "down-only-and-attention"])
def test_peft_expert_adapters_load_with_each_experts_rank(lora, ranks, tmp_path):
    _, base = make(tmp_path / "a", lora_alpha=8, **lora)
    adapter = load_adapter(tmp_path / "a", base)
    experts = BaseShapes.from_config(base).expert_layers
    assert experts == (0, 2)  # layer 1 is dense: no experts there
    expected = {f"layers.{layer}.{m}": r for m, r in ranks.items()
                for layer in (experts if m.startswith("experts") or m == "router" else range(3))}
    assert adapter.ranks == expected
    gate_up = adapter.tensors.get("layers.0.experts_gate_up_proj.lora_A")
    if gate_up is not None:
        assert gate_up.shape == (5 * ranks["experts_gate_up_proj"], 64)  # [E * r, hidden]
        assert adapter.tensors["layers.0.experts_gate_up_proj.lora_B"].shape == (80, 5 * ranks["experts_gate_up_proj"])
    if "experts_down_proj" in ranks:
        assert adapter.tensors["layers.2.experts_down_proj.lora_A"].shape == (5 * ranks["experts_down_proj"], 40)
    if "router" in ranks:  # mlp.gate [E, hidden]: a plain LoRA
        assert adapter.tensors["layers.2.router.lora_B"].shape == (5, ranks["router"])


def test_canonical_expert_adapter_is_a_peft_adapter(tmp_path):
    model, base = make(tmp_path / "a", r=4, lora_alpha=8, target_modules=["k_proj"],
                       target_parameters=[*EXPERTS, "mlp.gate.weight"], rank_pattern={"down_proj": 2})
    adapter = load_adapter(tmp_path / "a", base)
    canonical = adapter.save(tmp_path / "canonical")
    again = load_canonical(canonical)
    assert again.digest == adapter.digest and again.ranks == adapter.ranks
    assert load_adapter(canonical, base).digest == adapter.digest
    reloaded = PeftModel.from_pretrained(Qwen3MoeForCausalLM(moe_config()), canonical)
    original, back = lora_layers(model), lora_layers(reloaded)
    assert set(back) == set(original) and any("experts" in name for name in back)
    assert any(name.endswith("mlp.gate") for name in back)  # the router's
    for name, layer in original.items():
        assert back[name].r["default"] == layer.r["default"]
        assert back[name].scaling["default"] == layer.scaling["default"]
        assert torch.equal(back[name].lora_A["default"].weight, layer.lora_A["default"].weight)
        assert torch.equal(back[name].lora_B["default"].weight, layer.lora_B["default"].weight)


def test_qwen2_moe_shared_expert_adapter_round_trips_through_peft(tmp_path):
    """On Qwen2-MoE, PEFT puts target_modules gate/up/down on the shared expert's own modules."""
    torch.manual_seed(0)
    config = Qwen2MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
                            shared_expert_intermediate_size=56)
    model = get_peft_model(Qwen2MoeForCausalLM(config), LoraConfig(
        r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], target_parameters=EXPERTS))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param)
    model.save_pretrained(tmp_path / "a")
    adapter = load_adapter(tmp_path / "a", config.to_dict())
    assert adapter.tensors["layers.1.shared_expert_down_proj.lora_A"].shape == (4, 56)
    assert {name.split(".")[2] for name in adapter.ranks} == {
        "shared_expert_gate_proj", "shared_expert_up_proj", "shared_expert_down_proj", "experts_gate_up_proj",
        "experts_down_proj"}
    canonical = adapter.save(tmp_path / "canonical")
    assert load_canonical(canonical).digest == adapter.digest
    reloaded = PeftModel.from_pretrained(Qwen2MoeForCausalLM(config), canonical)
    original, back = lora_layers(model), lora_layers(reloaded)
    assert set(back) == set(original)
    for name, layer in original.items():
        assert torch.equal(back[name].lora_B["default"].weight, layer.lora_B["default"].weight)


def per_expert_files(directory, projections, *, r=2, experts=5, layers=(0, 2)) -> None:
    """An adapter as saved before transformers 5: one LoRA per expert module of moe_config()'s MoE layers."""
    import json

    import safetensors.torch

    widths = {"gate_proj": (64, 40), "up_proj": (64, 40), "down_proj": (40, 64)}
    tensors = {}
    for layer in layers:
        for expert in range(experts):
            for proj in projections:
                key = f"base_model.model.model.layers.{layer}.mlp.experts.{expert}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, widths[proj][0])
                tensors[f"{key}.lora_B.weight"] = torch.randn(widths[proj][1], r)
    directory.mkdir()
    safetensors.torch.save_file(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": 4, "target_modules": list(projections)}))


def test_per_expert_adapters_are_stacked_as_peft_stacks_them(tmp_path):
    per_expert_files(tmp_path / "a", ["gate_proj", "up_proj", "down_proj"])
    base = moe_config().to_dict()
    adapter = load_adapter(tmp_path / "a", base)
    assert adapter.ranks == {f"layers.{layer}.{m}": r for layer in (0, 2)
                             for m, r in (("experts_gate_up_proj", 4), ("experts_down_proj", 2))}
    assert adapter.scaling["layers.0.experts_gate_up_proj"] == 2.0  # alpha 2 * 4 over rank 2 * 2, as PEFT
    assert adapter.tensors["layers.0.experts_gate_up_proj.lora_B"].shape == (80, 5 * 4)
    assert load_canonical(adapter.save(tmp_path / "canonical")).digest == adapter.digest
    per_expert_files(tmp_path / "gate", ["gate_proj", "down_proj"])
    with pytest.raises(AdapterError, match="needs the other"):
        load_adapter(tmp_path / "gate", base)
    per_expert_files(tmp_path / "some", ["down_proj"], experts=3)
    with pytest.raises(AdapterError, match="all 5 experts") as refused:
        load_adapter(tmp_path / "some", base)
    assert refused.value.code == "tensor_missing"


def test_expert_adapters_are_refused_where_they_cannot_be_served(tmp_path):
    _, base = make(tmp_path / "q", r=2, target_modules=[], target_parameters=["self_attn.q_proj.weight"])
    with pytest.raises(AdapterError, match="none of the parameters") as refused:
        load_adapter(tmp_path / "q", base)
    assert refused.value.code == "unsupported_module"
    _, _ = make(tmp_path / "experts", r=2, target_modules=[], target_parameters=EXPERTS)
    with pytest.raises(AdapterError, match="has no experts"):  # the same adapter on a dense base
        load_adapter(tmp_path / "experts", llama_config().to_dict())
    fewer = {**base, "num_experts": 4}  # a base with other experts than the adapter was trained on
    with pytest.raises(AdapterError, match="expected") as refused:
        load_adapter(tmp_path / "experts", fewer)
    assert refused.value.code == "tensor_shape"
