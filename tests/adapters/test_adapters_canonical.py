"""The canonical form: save/load keeps the digest, PEFT reads it back, tampering is caught."""

import json

import pytest
import safetensors.torch
import torch
from peft import PeftModel
from transformers import LlamaForCausalLM

from adapters import AdapterError, load_adapter, load_canonical
from tests.adapters.builders import llama_config, lora_config, peft_lora_tensors, write_adapter
from tests.adapters.peft_made import lora_modules, make


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make("llama-mixed-ranks-and-patterns", tmp_path_factory.mktemp("peft"))


def test_round_trip_keeps_digest_and_tensors(made, tmp_path):
    adapter = load_adapter(made.directory, made.base_config)
    again = load_canonical(adapter.save(tmp_path / "canonical"))
    assert again.digest == adapter.digest
    assert (again.rank, again.ranks, again.alpha, again.scaling) == (
        adapter.rank,
        adapter.ranks,
        adapter.alpha,
        adapter.scaling,
    )
    assert (again.target_modules, again.num_bytes, again.config) == (
        adapter.target_modules,
        adapter.num_bytes,
        adapter.config,
    )
    assert again.tensors.keys() == adapter.tensors.keys()
    for name, tensor in adapter.tensors.items():
        assert torch.equal(again.tensors[name], tensor) and again.tensors[name].dtype == tensor.dtype


def test_canonical_folder_is_a_peft_adapter(made, tmp_path):
    """PEFT itself loads the canonical folder with every module's rank, scaling and weights intact."""
    adapter = load_adapter(made.directory, made.base_config)
    canonical = adapter.save(tmp_path / "canonical")
    assert load_adapter(canonical, made.base_config).digest == adapter.digest
    reloaded = PeftModel.from_pretrained(LlamaForCausalLM(llama_config()), canonical)
    original, back = lora_modules(made.model), lora_modules(reloaded)
    assert set(back) == set(original)
    for name, layer in original.items():
        assert back[name].r["default"] == layer.r["default"]
        assert back[name].scaling["default"] == layer.scaling["default"]
        assert torch.equal(back[name].lora_B["default"].weight, layer.lora_B["default"].weight)


def test_digest_covers_outputs_not_packaging(tmp_path, llama_base):
    config = lora_config()
    tensors = peft_lora_tensors(config)
    base = load_adapter(write_adapter(tmp_path / "a", config=config, tensors=tensors), llama_base)
    unwrapped = {name.removeprefix("base_model.model."): t for name, t in tensors.items()}
    renamed = load_adapter(write_adapter(tmp_path / "b", config=config, tensors=unwrapped), llama_base)
    no_suffix = {name.removesuffix(".weight"): t for name, t in tensors.items()}
    bare = load_adapter(write_adapter(tmp_path / "b2", config=config, tensors=no_suffix), llama_base)
    named = {name.replace(".weight", ".default.weight"): t for name, t in tensors.items()}
    with_name = load_adapter(write_adapter(tmp_path / "b3", config=config, tensors=named), llama_base)
    same_scaling = load_adapter(
        write_adapter(
            tmp_path / "c",
            config=lora_config(r=4, lora_alpha=4, alpha_pattern={"q_proj": 8, "v_proj": 8}),
            tensors=tensors,
        ),
        llama_base,
    )
    other_alpha = load_adapter(
        write_adapter(tmp_path / "d", config=lora_config(lora_alpha=16), tensors=tensors), llama_base
    )
    half = {name: t.half() for name, t in tensors.items()}
    other_dtype = load_adapter(write_adapter(tmp_path / "e", config=config, tensors=half), llama_base)
    nudged = dict(tensors, **{next(iter(tensors)): next(iter(tensors.values())) + 1e-3})
    other_bytes = load_adapter(write_adapter(tmp_path / "f", config=config, tensors=nudged), llama_base)
    assert base.digest == renamed.digest == bare.digest == with_name.digest == same_scaling.digest
    assert len({base.digest, other_alpha.digest, other_dtype.digest, other_bytes.digest}) == 4


def without_checksums(canonical):
    """The sidecar as Quilt wrote it before it kept checksums."""
    sidecar = json.loads((canonical / "quilt_adapter.json").read_text())
    del sidecar["checksums"]
    (canonical / "quilt_adapter.json").write_text(json.dumps(sidecar))
    return canonical


@pytest.mark.parametrize("known", [False, True], ids=["digest-unknown", "digest-known"])
def test_tampered_tensor_is_caught(made, tmp_path, known):
    adapter = load_adapter(made.directory, made.base_config)
    canonical = adapter.save(tmp_path / "canonical")
    weights = canonical / "adapter_model.safetensors"
    tensors = safetensors.torch.load_file(weights)
    first = next(iter(tensors))
    tensors[first] = tensors[first] * 2
    safetensors.torch.save_file(tensors, weights)
    digest = adapter.digest if known else None
    with pytest.raises(AdapterError) as refused:
        load_canonical(canonical, digest=digest)
    assert refused.value.code == "canonical_corrupt" and "adapter_model.safetensors changed" in refused.value.message
    with pytest.raises(AdapterError) as refused:  # an old sidecar: the digest is recomputed, whatever is known
        load_canonical(without_checksums(canonical), digest=digest)
    assert refused.value.code == "canonical_corrupt" and "digest" in refused.value.message


def test_an_old_sidecar_loads_by_its_digest(made, tmp_path):
    adapter = load_adapter(made.directory, made.base_config)
    canonical = without_checksums(adapter.save(tmp_path / "canonical"))
    assert load_canonical(canonical, digest=adapter.digest).digest == adapter.digest


@pytest.mark.parametrize("known", [False, True], ids=["digest-unknown", "digest-known"])
def test_tampered_scaling_is_caught(made, tmp_path, known):
    adapter = load_adapter(made.directory, made.base_config)
    canonical = adapter.save(tmp_path / "canonical")
    sidecar = json.loads((canonical / "quilt_adapter.json").read_text())
    sidecar["scaling"]["layers.0.q_proj"] *= 10
    (canonical / "quilt_adapter.json").write_text(json.dumps(sidecar))
    with pytest.raises(AdapterError) as refused:
        load_canonical(canonical, digest=adapter.digest if known else None)
    assert refused.value.code == "canonical_corrupt" and "quilt_adapter.json changed" in refused.value.message


def test_not_a_canonical_folder(made, tmp_path):
    with pytest.raises(AdapterError) as refused:
        load_canonical(made.directory)
    assert refused.value.code == "canonical_corrupt" and "quilt_adapter.json" in refused.value.message


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda sidecar: sidecar["ranks"].update({"layers.0.q_proj": 5}), id="rank-lies"),
        pytest.param(lambda sidecar: sidecar.pop("scaling"), id="field-missing"),
        pytest.param(lambda sidecar: sidecar["config"].update(format="quilt-lora/0"), id="other-format"),
    ],
)
def test_damaged_sidecar_is_caught(made, tmp_path, damage):
    canonical = load_adapter(made.directory, made.base_config).save(tmp_path / "canonical")
    sidecar = json.loads((canonical / "quilt_adapter.json").read_text())
    damage(sidecar)
    (canonical / "quilt_adapter.json").write_text(json.dumps(sidecar))
    with pytest.raises(AdapterError) as refused:
        load_canonical(canonical)
    assert refused.value.code == "canonical_corrupt"


def test_loaded_tensors_do_not_follow_later_changes_to_the_file(tmp_path, llama_base):
    directory = write_adapter(tmp_path / "a")
    adapter = load_adapter(directory, llama_base)
    before = {name: t.clone() for name, t in adapter.tensors.items()}
    weights = directory / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64)
    with open(weights, "r+b") as handle:  # in place, as a careless writer would
        handle.write(bytes(data))
    assert all(torch.equal(adapter.tensors[name], t) for name, t in before.items())
    assert load_adapter(directory, llama_base).digest != adapter.digest
