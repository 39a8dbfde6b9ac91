"""Every way an adapter's config or weights can be wrong is refused with its own code and a message a
tenant can act on, and nothing is left in the temporary directory (the autouse `scratch` fixture checks)."""

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch

import adapters
import adapters.errors
from adapters import AdapterError, load_adapter
from tests.adapters.builders import (
    distinct_refusal_messages,
    file_source,
    lora_config,
    peft_lora_tensors,
    raw_safetensors,
    refusal,
    split_safetensors,
    valid_weights_bytes,
    write_adapter,
)

Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
V1 = "base_model.model.model.layers.1.self_attn.v_proj"


def with_tensors(mutate: Callable[[dict], None], **config) -> Callable[[Path], Path]:
    def build(tmp: Path) -> Path:
        cfg = lora_config(**config)
        tensors = peft_lora_tensors(cfg)
        mutate(tensors)
        return write_adapter(tmp / "adapter", config=cfg, tensors=tensors)

    return build


def with_config(**overrides) -> Callable[[Path], Path]:
    return lambda tmp: write_adapter(
        tmp / "adapter", config=lora_config(**overrides), tensors=peft_lora_tensors(lora_config())
    )


def with_weights(make: Callable[[], bytes]) -> Callable[[Path], Path]:
    return lambda tmp: write_adapter(tmp / "adapter", raw_weights=make())


def set_(key: str, value) -> Callable[[dict], None]:
    return lambda tensors: tensors.__setitem__(key, value)


def drop(*keys: str) -> Callable[[dict], None]:
    return lambda tensors: [tensors.pop(key) for key in keys]


def retype(dtype: torch.dtype) -> Callable[[dict], None]:
    return lambda tensors: tensors.__setitem__(
        f"{Q0}.lora_A.weight", tensors[f"{Q0}.lora_A.weight"].to(dtype)
    )


def poison(value: float) -> Callable[[dict], None]:
    def mutate(tensors: dict) -> None:
        tensors[f"{V1}.lora_B.weight"][3, 1] = value

    return mutate


def without(name: str) -> Callable[[Path], Path]:
    def build(tmp: Path) -> Path:
        directory = write_adapter(tmp / "adapter")
        (directory / name).unlink()
        return directory

    return build


def pickled_weights(tmp: Path) -> Path:
    """What save_pretrained(safe_serialization=False) writes."""
    return write_adapter(tmp / "adapter", weights_name="", extra_files={"adapter_model.bin": b"\x80\x04."})


def full_model(tmp: Path) -> Path:
    directory = write_adapter(tmp / "model", weights_name="model.safetensors")
    (directory / "adapter_config.json").rename(directory / "config.json")
    return directory


def truncated() -> bytes:
    return valid_weights_bytes()[:-100]


def overlapping_offsets() -> bytes:
    header, data = split_safetensors(valid_weights_bytes())
    q_offsets = header[f"{Q0}.lora_A.weight"]["data_offsets"]
    header[f"{V1}.lora_A.weight"]["data_offsets"] = q_offsets  # both are [4, 64] float32
    return raw_safetensors(header, data)


def offsets_past_end() -> bytes:
    header, data = split_safetensors(valid_weights_bytes())
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    begin, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [begin + 64, end + 64]
    return raw_safetensors(header, data)


def size_mismatch() -> bytes:
    header, data = split_safetensors(valid_weights_bytes())
    header[f"{Q0}.lora_A.weight"]["shape"] = [4, 65]
    return raw_safetensors(header, data)


def trailing_bytes() -> bytes:
    return valid_weights_bytes() + b"\0" * 16


def duplicate_header_key() -> bytes:
    header, data = split_safetensors(valid_weights_bytes())
    entry = json.dumps(header[f"{Q0}.lora_A.weight"])
    encoded = json.dumps(header)[:-1] + f', "{Q0}.lora_A.weight": {entry}}}'
    return len(encoded).to_bytes(8, "little") + encoded.encode() + data


# fmt: off
CASES = [
    # what PEFT writes but Quilt refuses
    ("pickle-weights", pickled_weights, "pickle_file", "adapter_model.bin"),
    ("pickle-file-as-source", file_source("adapter.pth", b"PK\x03\x04"), "pickle_file", "adapter.pth is a pickle"),
    ("use-dora", with_config(use_dora=True), "dora_unsupported", "DoRA"),
    ("dora-magnitude-tensor", with_tensors(set_(f"{Q0}.lora_magnitude_vector", torch.ones(96))), "dora_unsupported", "DoRA magnitude"),
    ("modules-to-save", with_config(modules_to_save=["lm_head"]), "modules_to_save_unsupported", "modules_to_save"),
    ("modules-to-save-tensor", with_tensors(set_("base_model.model.lm_head.modules_to_save.default.weight", torch.ones(2, 2))), "modules_to_save_unsupported", "fully retrained"),
    ("embedding-target", with_config(target_modules=["q_proj", "embed_tokens"]), "embedding_unsupported", "not served yet"),
    ("embedding-tensor", with_tensors(set_("base_model.model.model.embed_tokens.lora_embedding_A", torch.ones(4, 128))), "embedding_unsupported", "embeddings"),
    ("lm-head-target", with_config(target_modules=["q_proj", "lm_head"]), "lm_head_unsupported", "not served yet"),
    ("trainable-tokens", with_config(trainable_token_indices=[1, 2]), "embedding_unsupported", "trainable_token_indices"),
    ("peft-type-prefix", with_config(peft_type="PREFIX_TUNING"), "not_lora", "'PREFIX_TUNING'"),
    ("task-seq-cls", with_config(task_type="SEQ_CLS"), "unsupported_task", "'SEQ_CLS'"),
    ("full-model-not-adapter", full_model, "config_missing", "full model"),
    ("bare-safetensors", file_source("adapter_model.safetensors", b"x" * 64), "unsupported_source", "alone is not an adapter"),
    ("peft-type-missing", with_config(peft_type=None), "not_lora", "only LORA"),
    ("fan-in-fan-out", with_config(fan_in_fan_out=True), "fan_in_fan_out_unsupported", "Conv1D"),
    ("bias-all", with_config(bias="all"), "bias_unsupported", "biases"),
    ("lora-bias-tensor", with_tensors(set_(f"{Q0}.lora_B.bias", torch.ones(96))), "bias_unsupported", "is a bias"),
    ("pissa-init", with_config(init_lora_weights="pissa_niter_4"), "unsupported_option", "rewrites the base weights"),
    ("layer-replication", with_config(layer_replication=[[0, 2], [1, 2]]), "unsupported_option", "layer_replication"),
    # config problems
    ("config-missing", without("adapter_config.json"), "config_missing", "adapter_config.json"),
    ("config-not-json", lambda tmp: write_adapter(tmp / "a", raw_config=b'{"r": 8,'), "config_invalid_json", "not valid JSON"),
    ("config-not-object", lambda tmp: write_adapter(tmp / "a", raw_config=b"[1, 2]"), "config_invalid", "JSON object"),
    ("config-rank-not-int", with_config(r="eight"), "config_invalid", "r must be a positive integer"),
    ("config-bad-regex", with_config(target_modules=".*(q_proj"), "config_invalid", "not a valid regular expression"),
    ("layers-pattern-not-text", with_config(layers_to_transform=[0], layers_pattern=5), "config_invalid", "layers_pattern must be"),
    ("layers-to-transform-not-int", with_config(layers_to_transform=["0"]), "config_invalid", "layers_to_transform must be"),
    ("regex-nested-repeat", with_config(target_modules="(.*_proj)+"), "config_too_complex", "exponential time"),
    ("regex-alternation-in-repeat", with_config(alpha_pattern={"(self_attn\\.|mlp\\.)*q_proj": 2}), "config_too_complex", "an alternative inside a repetition"),
    ("regex-too-many-repeats", with_config(rank_pattern={".*.*.*.*z": 8}), "config_too_complex", "repeats 4 times"),
    ("targets-a-norm", with_config(target_modules=".*\\.(q_proj|input_layernorm)"), "unsupported_module", "input_layernorm"),
    ("targets-a-container", with_config(target_modules=["q_proj", "mlp"]), "unsupported_module", "'model.layers.0.mlp' (MLP)"),
    ("targets-everything", with_config(target_modules=".*"), "unsupported_module", "the root module (model)"),
    ("targets-a-missing-module", with_config(target_modules=["q_proj", "c_attn"]), "unsupported_module",
     "c_attn, which a Llama base (LlamaForCausalLM) does not have"),
    ("targets-nothing", with_config(target_modules=".*\\.c_attn"), "no_target_modules", "matches none"),
    # weights problems
    ("weights-missing", without("adapter_model.safetensors"), "weights_missing", "adapter_model.safetensors"),
    ("unknown-tensor", with_tensors(set_("base_model.model.model.layers.0.self_attn.rotary.lora_A.weight", torch.ones(4, 64))), "unsupported_module", "adapts rotary, which a Llama base (LlamaForCausalLM) does not have"),
    ("untargeted-module", with_tensors(set_("base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight", torch.ones(4, 64))), "tensor_unknown", "does not target"),
    ("layer-out-of-range", with_tensors(set_("base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight", torch.ones(4, 64))), "tensor_unknown", "has 2 layers"),
    ("module-missing", with_tensors(drop(f"{V1}.lora_A.weight", f"{V1}.lora_B.weight")), "tensor_missing", "layer 1 v_proj"),
    ("a-without-b", with_tensors(drop(f"{V1}.lora_B.weight")), "tensor_unpaired", "layer 1 v_proj: lora_A is present but lora_B is missing"),
    ("stored-twice", with_tensors(set_(f"{Q0}.lora_A", torch.ones(4, 64))), "tensor_duplicate", "stored twice"),
    ("mixed-adapter-names", with_tensors(set_(f"{Q0}.lora_A.other.weight", torch.ones(4, 64))), "multiple_adapters", "several adapter names"),
    ("wrong-out-shape", with_tensors(set_(f"{V1}.lora_B.weight", torch.ones(96, 4))), "tensor_shape", "layer 1 v_proj: lora_B has shape [96, 4], expected [48, 4] for this base model"),
    ("rank-disagrees-with-config", with_tensors(set_(f"{Q0}.lora_A.weight", torch.ones(2, 64))), "tensor_shape", "expected [4, 64] for this base model and r=4"),
    ("one-dimensional", with_tensors(set_(f"{Q0}.lora_B.weight", torch.ones(96))), "tensor_shape", "lora_B has shape [96]"),
    ("rank-above-max", lambda tmp: write_adapter(tmp / "a", config=lora_config(r=300), tensors=peft_lora_tensors(lora_config(r=300))), "rank_too_large", "rank 300"),
    ("dtype-float64", with_tensors(retype(torch.float64)), "dtype_unsupported", "F64"),
    ("dtype-int8", with_tensors(retype(torch.int8)), "dtype_unsupported", "float16, bfloat16 or float32"),
    ("nan", with_tensors(poison(math.nan)), "tensor_not_finite", "layer 1 v_proj: lora_B contains 1 NaN value(s)"),
    ("inf", with_tensors(poison(math.inf)), "tensor_not_finite", "contains 1 infinite value(s)"),
    ("truncated-file", with_weights(truncated), "safetensors_truncated", "truncated"),
    ("tiny-file", with_weights(lambda: b"\x10\x00"), "safetensors_truncated", "too short"),
    ("header-size-absurd", with_weights(lambda: (1 << 40).to_bytes(8, "little") + b"{}"), "safetensors_header_too_large", "header"),
    ("header-size-past-eof", with_weights(lambda: raw_safetensors({}, b"", declared_header_size=4096)), "safetensors_truncated", "4096-byte header"),
    ("header-not-json", with_weights(lambda: raw_safetensors({}, b"")[:8] + b"\xff\xfe"), "safetensors_invalid", "not a safetensors file"),
    ("offsets-overlap", with_weights(overlapping_offsets), "safetensors_invalid", "lies about offsets"),
    ("offsets-past-end", with_weights(offsets_past_end), "safetensors_invalid", "lies about offsets"),
    ("offsets-disagree-with-shape", with_weights(size_mismatch), "safetensors_invalid", "needs 1040"),
    ("trailing-bytes", with_weights(trailing_bytes), "safetensors_invalid", "16 bytes after the last tensor"),
    ("duplicate-header-key", with_weights(duplicate_header_key), "safetensors_invalid", "names a tensor twice"),
]
# fmt: on


@pytest.mark.parametrize(
    ("build", "code", "fragment"), [pytest.param(*case[1:], id=case[0]) for case in CASES]
)
def test_refused_with_its_own_message(tmp_path, llama_base, build, code, fragment):
    refused = refusal(build, tmp_path, llama_base)
    assert refused.code == code, refused.message
    assert fragment in refused.message


def test_cases_have_distinct_messages(tmp_path, llama_base):
    assert len(CASES) >= 30
    assert len(distinct_refusal_messages(CASES, tmp_path, llama_base)) == len(CASES)


def test_unsupported_base_model(tmp_path):
    with pytest.raises(AdapterError) as refused:
        load_adapter(write_adapter(tmp_path / "a"), {"model_type": "gpt2", "n_embd": 64})
    assert refused.value.code == "unsupported_base_model"
    assert "'gpt2'" in refused.value.message


def test_error_is_a_value_error():
    assert issubclass(AdapterError, ValueError)
    error = AdapterError("tensor_shape", "layer 0 q_proj: bad")
    assert (error.code, str(error)) == ("tensor_shape", "layer 0 q_proj: bad")


def test_bf16_and_f16_weights_are_accepted(tmp_path, llama_base):
    for dtype in (torch.float16, torch.bfloat16):
        config = lora_config()
        directory = write_adapter(
            tmp_path / str(dtype), config=config, tensors=peft_lora_tensors(config, dtype=dtype)
        )
        adapter = load_adapter(directory, llama_base)
        assert {t.dtype for t in adapter.tensors.values()} == {dtype}


def test_weights_file_written_by_safetensors_itself_round_trips(tmp_path, llama_base):
    tensors = peft_lora_tensors(lora_config())
    adapter = load_adapter(write_adapter(tmp_path / "a", tensors=tensors), llama_base)
    assert torch.equal(adapter.tensors["layers.1.v_proj.lora_B"], tensors[f"{V1}.lora_B.weight"])
    assert safetensors.torch.load(valid_weights_bytes()).keys() == tensors.keys()


def test_every_code_is_documented():
    package = Path(adapters.__file__).parent
    documented = set(re.findall(r"\b[a-z]+(?:_[a-z]+)+\b", adapters.errors.__doc__))
    raised = {
        code
        for source in package.glob("*.py")
        for code in re.findall(r'AdapterError\(\s*"([a-z_]+)"', source.read_text())
    }
    assert raised and raised == documented


def test_huge_finite_values_are_not_mistaken_for_inf(tmp_path, llama_base):
    config = lora_config()
    tensors = peft_lora_tensors(config)
    tensors[f"{V1}.lora_B.weight"].fill_(3e38)  # finite, but its float32 sum overflows
    adapter = load_adapter(write_adapter(tmp_path / "a", config=config, tensors=tensors), llama_base)
    assert adapter.tensors["layers.1.v_proj.lora_B"].max().item() == pytest.approx(3e38)
