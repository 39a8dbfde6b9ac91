"""Every field of a `quantization_config` that the producers write is either read or refused, never ignored
(engine/quantization/spec.py FIELDS): the field lists come from the producers themselves where they are installed
(transformers' GPTQConfig, AwqConfig and FineGrainedFP8Config, compressed-tensors' pydantic models and the names
its ModelCompressor writes) and from GPTQModel's `to_dict` (not installable on CPU here: its fields are spelled
below). Each read field either serves every value a producer writes, or has a value that is refused at start with
an error naming the field; a field nobody knows is refused naming it. Nothing here loads a model."""

import pytest

from engine.quantization import checkpoint_quantization
from engine.quantization.spec import FIELDS
from tests.engine.fp8_checkpoints import BLOCK_CONFIG, GPTQMODEL_BLOCK_CONFIG

# GPTQModel 7's BaseQuantizeConfig.to_dict writes these for every method (None values left out), then each config
# adds its own (_update_output_payload): GPTQConfig sym; AWQConfig zero_point, version; FP8Config the three below.
GPTQMODEL_COMMON = {"bits", "dynamic", "group_size", "desc_act", "lm_head", "method", "quant_method", "format",
                    "checkpoint_format", "pack_dtype", "rotation", "meta"}
GPTQMODEL = {"gptq": GPTQMODEL_COMMON | {"sym"}, "awq": GPTQMODEL_COMMON | {"zero_point", "version"},
             "fp8": GPTQMODEL_COMMON | {"weight_scale_method", "weight_block_size", "weight_scale_semantics"}}

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False,
        "checkpoint_format": "gptq_v2", "format": "gptq_v2", "pack_dtype": "int32", "lm_head": False}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm", "format": "gemm"}
WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128, "dynamic": False,
           "actorder": "static", "observer": "minmax", "observer_kwargs": {}}
CT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": WEIGHTS, "input_activations": None,
                                    "output_activations": None, "format": "pack-quantized"}},
      "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
      "moe_sparsity_config": None, "global_compression_ratio": None, "version": "0.20.0"}
FP8_DYNAMIC = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True,
               "observer": None}


def _ct(weights=None, acts=None, **top):
    """CT with its weights' fields updated, those input activations, and the top level's (its format the
    group's too)."""
    group = {**CT["config_groups"]["group_0"], "weights": {**WEIGHTS, **(weights or {})}}
    if acts is not None:
        group["input_activations"] = acts
    if "format" in top:
        group["format"] = top["format"]
    return {**CT, "config_groups": {"group_0": group}, **top}


FP8_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel", "group_size": None, "actorder": None}


def _spec(quant: dict):
    return checkpoint_quantization({"quantization_config": quant}, quantization=None)


SERVED = [GPTQ, {**GPTQ, "desc_act": False, "sym": True, "checkpoint_format": "gptq", "format": "gptq"}, AWQ,
          BLOCK_CONFIG, GPTQMODEL_BLOCK_CONFIG, CT, _ct({"actorder": None}), _ct({"actorder": "weight"}),
          _ct(FP8_WEIGHTS, FP8_DYNAMIC, format="float-quantized")]


@pytest.mark.parametrize("quant", SERVED, ids=lambda q: f"{q['quant_method']}-{q.get('format', q.get('fmt'))}")
def test_what_the_producers_write_is_served(quant):
    assert _spec(quant) is not None


def test_every_field_a_producer_writes_is_read_or_inert():
    from compressed_tensors.base import COMPRESSION_VERSION_NAME, SPARSITY_CONFIG_NAME, TRANSFORM_CONFIG_NAME
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from transformers import AwqConfig, FineGrainedFP8Config, GPTQConfig

    written = {
        "gptq": set(GPTQConfig(bits=4).to_dict()) | GPTQMODEL["gptq"],
        "awq": set(AwqConfig(bits=4).to_dict()) | GPTQMODEL["awq"],
        "fp8": set(FineGrainedFP8Config().to_dict()) | GPTQMODEL["fp8"] | set(GPTQMODEL_BLOCK_CONFIG),
        "compressed-tensors": set(QuantizationConfig.model_fields) | {SPARSITY_CONFIG_NAME, TRANSFORM_CONFIG_NAME,
                                                                      COMPRESSION_VERSION_NAME},
        "compressed-tensors group": set(QuantizationScheme.model_fields),
        "compressed-tensors args": set(QuantizationArgs.model_fields),
    }
    for where, fields in written.items():
        known = FIELDS[where]
        assert not known["read"] & known["inert"], where
        assert fields <= known["read"] | known["inert"], f"{where}: {sorted(fields - known['read'] - known['inert'])}"


# (where, field, the config with an unserved value of it, what the error says); every read field is here or in
# EVERY_VALUE_SERVED
REFUSED = [
    ("gptq", "bits", {**GPTQ, "bits": 3}, "3-bit weights are not served"),
    ("gptq", "group_size", {**GPTQ, "group_size": 16}, "group size 16 is not served"),
    ("gptq", "checkpoint_format", {**GPTQ, "checkpoint_format": "marlin", "format": "marlin"},
     "checkpoint format 'marlin' is not served"),
    ("gptq", "format", {**GPTQ, "format": "gptq"}, "names two formats: {'checkpoint_format': 'gptq_v2', 'format'"),
    ("gptq", "pack_dtype", {**GPTQ, "pack_dtype": "int16"}, "pack_dtype 'int16' is not served; served: int32"),
    ("gptq", "lm_head", {**GPTQ, "lm_head": True}, "lm_head True is not served"),
    ("gptq", "dynamic", {**GPTQ, "dynamic": {r"+:.*\.down_proj": {"bits": 8}}}, "dynamic .* is not served"),
    ("gptq", "rotation", {**GPTQ, "rotation": "hadamard"}, "rotation 'hadamard' is not served"),
    ("gptq", "is_marlin_format", {**GPTQ, "is_marlin_format": True}, "is_marlin_format True is not served"),
    ("awq", "version", {**AWQ, "version": "gemv", "format": "gemv"}, "version 'gemv' is not served"),
    ("awq", "format", {**AWQ, "format": "gemv_fast"}, "names two formats"),
    ("awq", "checkpoint_format", {**AWQ, "checkpoint_format": "gemv"}, "names two formats"),
    ("awq", "zero_point", {**AWQ, "zero_point": False}, "zero_point false is not served"),
    ("awq", "bits", {**AWQ, "bits": 8}, "8-bit weights are not served"),
    ("awq", "group_size", {**AWQ, "group_size": 16}, "group size 16 is not served"),
    ("awq", "desc_act", {**AWQ, "desc_act": True}, "desc_act True is not served"),
    ("awq", "pack_dtype", {**AWQ, "pack_dtype": "int64"}, "pack_dtype 'int64' is not served"),
    ("awq", "lm_head", {**AWQ, "lm_head": True}, "lm_head True is not served"),
    ("awq", "dynamic", {**AWQ, "dynamic": {"-:.*mlp.*": {}}}, "dynamic .* is not served"),
    ("awq", "rotation", {**AWQ, "rotation": "hadamard"}, "rotation 'hadamard' is not served"),
    ("awq", "is_marlin_format", {**AWQ, "is_marlin_format": True}, "is_marlin_format True is not served"),
    ("fp8", "weight_scale_semantics", {**GPTQMODEL_BLOCK_CONFIG, "weight_scale_semantics": "direct"},
     "weight_scale_semantics 'direct' is not served; served: 'inverse'"),
    ("fp8", "weight_scale_method", {**GPTQMODEL_BLOCK_CONFIG, "weight_scale_method": "row",
                                    "weight_block_size": None}, "weight_scale_method 'row' is not served"),
    ("fp8", "weight_block_size", {**BLOCK_CONFIG, "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
    ("fp8", "activation_scheme", {**BLOCK_CONFIG, "activation_scheme": "static"}, "activation_scheme 'static'"),
    ("fp8", "fmt", {**BLOCK_CONFIG, "fmt": "e5m2"}, "fmt 'e5m2' is not served; served: e4m3"),
    ("fp8", "format", {**GPTQMODEL_BLOCK_CONFIG, "format": "float8_e5m2"}, "format 'float8_e5m2' is not served"),
    ("fp8", "checkpoint_format", {**GPTQMODEL_BLOCK_CONFIG, "checkpoint_format": "float8_e4m3fnuz"},
     "checkpoint_format 'float8_e4m3fnuz' is not served"),
    ("fp8", "scale_fmt", {**BLOCK_CONFIG, "scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0' is not served"),
    ("fp8", "expert_dtype", {**BLOCK_CONFIG, "expert_dtype": "fp4"}, "expert_dtype 'fp4' is not served"),
    ("fp8", "bits", {**GPTQMODEL_BLOCK_CONFIG, "bits": 4}, "bits 4 is not served"),
    ("fp8", "group_size", {**GPTQMODEL_BLOCK_CONFIG, "group_size": 128}, "group_size 128 is not served"),
    ("fp8", "desc_act", {**GPTQMODEL_BLOCK_CONFIG, "desc_act": True}, "desc_act True is not served"),
    ("fp8", "sym", {**GPTQMODEL_BLOCK_CONFIG, "sym": False}, "sym False is not served"),
    ("fp8", "lm_head", {**GPTQMODEL_BLOCK_CONFIG, "lm_head": True}, "lm_head True is not served"),
    ("fp8", "dynamic", {**GPTQMODEL_BLOCK_CONFIG, "dynamic": {"-:.*": {}}}, "dynamic .* is not served"),
    ("fp8", "rotation", {**GPTQMODEL_BLOCK_CONFIG, "rotation": "hadamard"}, "rotation 'hadamard' is not served"),
    ("fp8", "is_marlin_format", {**BLOCK_CONFIG, "is_marlin_format": True}, "is_marlin_format True"),
    ("compressed-tensors", "format", {**CT, "format": "marlin-24"},
     "names two formats: format 'marlin-24', config_groups.group_0.format 'pack-quantized'"),
    ("compressed-tensors", "config_groups", {**CT, "config_groups": {
        "group_0": CT["config_groups"]["group_0"],
        "group_1": {**CT["config_groups"]["group_0"], "weights": {**WEIGHTS, "num_bits": 8}}}},
     "2 config_groups with 2 different schemes"),
    ("compressed-tensors", "kv_cache_scheme", _ct(kv_cache_scheme={"num_bits": 8, "type": "float"}),
     "kv_cache_scheme .* is not served; served: none"),
    ("compressed-tensors", "sparsity_config", _ct(sparsity_config={"format": "sparse-24-bitmask"}),
     "sparsity_config .* is not served"),
    ("compressed-tensors", "transform_config", _ct(transform_config={"config_groups": {"u": {"type": "hadamard"}}}),
     "transform_config .* is not served"),
    ("compressed-tensors", "moe_sparsity_config", _ct(moe_sparsity_config={"experts": 2}),
     "moe_sparsity_config .* is not served"),
    ("compressed-tensors group", "format", _ct(format="nvfp4-pack-quantized"),
     "'compressed-tensors:nvfp4-pack-quantized' .*is not supported"),
    ("compressed-tensors group", "input_activations", _ct(FP8_WEIGHTS, {**FP8_DYNAMIC, "symmetric": False},
                                                          format="float-quantized"),
     "input activations .*symmetric': False.* are not served"),
    ("compressed-tensors group", "weights", _ct({"num_bits": 2}), "2-bit weights are not served"),
    ("compressed-tensors group", "input_activations", _ct(acts=FP8_DYNAMIC),
     "only weight-only integer schemes .* are served"),
    ("compressed-tensors group", "output_activations", {**CT, "config_groups": {"group_0": {
        **CT["config_groups"]["group_0"], "output_activations": FP8_DYNAMIC}}},
     "output_activations .* is not served; served: none"),
    ("compressed-tensors args", "num_bits", _ct({"num_bits": 3}), "3-bit weights are not served"),
    ("compressed-tensors args", "type", _ct({"type": "float"}), "only weight-only integer schemes"),
    ("compressed-tensors args", "symmetric", _ct({**FP8_WEIGHTS, "symmetric": False}, format="float-quantized"),
     "weights symmetric false is not served"),
    ("compressed-tensors args", "group_size", _ct({"group_size": 16}), "group size 16 is not served"),
    ("compressed-tensors args", "strategy", _ct({"strategy": "tensor", "group_size": None}),
     "strategy 'tensor' is not served; served: group, channel"),
    ("compressed-tensors args", "block_structure", _ct({"strategy": "block", "block_structure": [128, 128],
                                                        "group_size": None}), "strategy 'block' is not served"),
    ("compressed-tensors args", "dynamic", _ct({"dynamic": True}), "weights dynamic True is not served"),
    ("compressed-tensors args", "actorder", _ct({"actorder": "group"}),
     "weights actorder 'group' \\(act order, g_idx stored\\) is not served"),
    ("compressed-tensors args", "scale_dtype", _ct({"scale_dtype": "torch.float8_e4m3fn"}),
     "weights scale_dtype 'torch.float8_e4m3fn' is not served"),
    ("compressed-tensors args", "zp_dtype", _ct({"zp_dtype": "torch.uint4"}), "weights zp_dtype 'torch.uint4' is not"),
]
EVERY_VALUE_SERVED = {  # read fields every value of which a producer writes is served
    "gptq": {"quant_method", "method", "desc_act", "sym"},
    "awq": {"quant_method", "method"},
    "fp8": {"quant_method", "method", "pack_dtype"},  # fp8: nothing packed, the field is GPTQModel's default
    "compressed-tensors": {"quant_method"},
    "compressed-tensors group": set(),
    "compressed-tensors args": set(),
}


def test_every_read_field_is_served_whole_or_refused_for_a_value():
    for where, known in FIELDS.items():
        covered = {field for at, field, _, _ in REFUSED if at == where} | EVERY_VALUE_SERVED[where]
        assert covered == known["read"], f"{where}: {sorted(known['read'] ^ covered)}"


@pytest.mark.parametrize(("where", "field", "quant", "message"), REFUSED, ids=[f"{w}-{f}" for w, f, _, _ in REFUSED])
def test_a_value_not_served_is_refused_naming_the_field(where, field, quant, message):
    with pytest.raises(ValueError, match=message):
        _spec(quant)


@pytest.mark.parametrize(("quant", "where"), [
    ({**GPTQ, "v3_alpha": 0.5}, r"\(gptq\): field 'v3_alpha'"),
    ({**AWQ, "krot": 8}, r"\(awq\): field 'krot'"),
    ({**GPTQMODEL_BLOCK_CONFIG, "weight_scale_offset": 1.0}, r"\(fp8\): field 'weight_scale_offset'"),
    ({**CT, "rotation_config": {}}, r"\(compressed-tensors\): field 'rotation_config'"),
    ({**CT, "config_groups": {"group_0": {**CT["config_groups"]["group_0"], "bias": None}}},
     r"\(config_groups.group_0\): field 'bias'"),
    (_ct({"global_scale": 2.0}), r"\(config_groups.group_0.weights\): field 'global_scale'"),
], ids=["gptq", "awq", "fp8", "compressed-tensors", "scheme", "args"])
def test_a_field_nobody_knows_is_refused_naming_it(quant, where):
    with pytest.raises(ValueError, match=f"quantization_config {where} is not known to this engine"):
        _spec(quant)
