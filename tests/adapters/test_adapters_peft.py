"""Adapters written by PEFT load with exactly the ranks, scalings and tensors PEFT itself uses."""

import tarfile
import zipfile

import pytest
import torch

from adapters import AdapterError, load_adapter
from tests.adapters.peft_made import SCENARIOS, lora_modules, make


@pytest.fixture(scope="module", params=list(SCENARIOS))
def made(request, tmp_path_factory):
    return make(request.param, tmp_path_factory.mktemp(request.param))


def test_modules_ranks_and_scaling_match_peft(made):
    adapter = load_adapter(made.directory, made.base_config)
    peft_layers = lora_modules(made.model)
    assert set(adapter.ranks) == set(peft_layers)
    assert set(adapter.scaling) == set(peft_layers)
    for name, layer in peft_layers.items():
        assert adapter.ranks[name] == layer.r["default"], name
        assert adapter.scaling[name] == layer.scaling["default"], name
    assert adapter.rank == max(layer.r["default"] for layer in peft_layers.values())
    assert adapter.alpha == made.lora["lora_alpha"]
    assert adapter.target_modules == [
        m
        for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
        if any(name.endswith(f".{m}") for name in peft_layers)
    ]


def test_tensors_equal_peft_weights(made):
    adapter = load_adapter(made.directory, made.base_config)
    peft_layers = lora_modules(made.model)
    assert set(adapter.tensors) == {f"{name}.{half}" for name in peft_layers for half in ("lora_A", "lora_B")}
    for name, layer in peft_layers.items():
        a, b = adapter.tensors[f"{name}.lora_A"], adapter.tensors[f"{name}.lora_B"]
        assert torch.equal(a, layer.lora_A["default"].weight), name
        assert torch.equal(b, layer.lora_B["default"].weight), name
        assert a.dtype == layer.lora_A["default"].weight.dtype
    assert adapter.num_bytes == sum(t.numel() * t.element_size() for t in adapter.tensors.values())


def test_delta_reproduces_peft_forward(made):
    """scaling * (x @ A.T) @ B.T is exactly what PEFT adds to each projection's output."""
    adapter = load_adapter(made.directory, made.base_config)
    generator = torch.Generator().manual_seed(1)
    for name, layer in lora_modules(made.model).items():
        a, b = adapter.tensors[f"{name}.lora_A"].double(), adapter.tensors[f"{name}.lora_B"].double()
        dtype = layer.lora_A["default"].weight.dtype
        x = torch.randn(3, a.shape[1], generator=generator).to(dtype)  # [tokens, in]
        with torch.no_grad():
            peft_delta = (layer(x) - layer.base_layer(x)).double()
        ours = adapter.scaling[name] * (x.double() @ a.T) @ b.T
        tolerance = 1e-5 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(peft_delta, ours, rtol=tolerance, atol=tolerance * ours.abs().max().item())


def test_zip_tar_and_wrapped_folders_share_the_digest(made, tmp_path):
    direct = load_adapter(made.directory, made.base_config)
    files = sorted(made.directory.iterdir())
    with zipfile.ZipFile(tmp_path / "flat.zip", "w", zipfile.ZIP_DEFLATED) as archive:
        for path in files:
            archive.write(path, path.name)
    with zipfile.ZipFile(tmp_path / "wrapped.zip", "w", zipfile.ZIP_DEFLATED) as archive:
        for path in files:
            archive.write(path, f"my-adapter/{path.name}")
    for name, mode in (("upload.tar.gz", "w:gz"), ("upload.tgz", "w:gz"), ("upload.tar", "w")):
        with tarfile.open(tmp_path / name, mode) as archive:
            archive.add(made.directory, arcname="checkpoint-100")
    for name in ("flat.zip", "wrapped.zip", "upload.tar.gz", "upload.tgz", "upload.tar"):
        assert load_adapter(tmp_path / name, made.base_config).digest == direct.digest, name


def test_max_rank_is_enforced_per_module(made):
    highest = max(layer.r["default"] for layer in lora_modules(made.model).values())
    assert load_adapter(str(made.directory), made.base_config, max_rank=highest).rank == highest
    with pytest.raises(AdapterError) as refused:
        load_adapter(str(made.directory), made.base_config, max_rank=highest - 1)
    assert refused.value.code == "rank_too_large"
    assert f"has rank {highest}; this deployment serves ranks up to {highest - 1}" in refused.value.message


def test_base_config_without_head_dim(made):
    base_config = dict(made.base_config, head_dim=None)
    if made.base_config.get("head_dim") not in (
        None,
        base_config["hidden_size"] // base_config["num_attention_heads"],
    ):
        with pytest.raises(AdapterError) as refused:
            load_adapter(made.directory, base_config)
        assert refused.value.code == "tensor_shape"
    else:
        assert load_adapter(made.directory, base_config).rank > 0
