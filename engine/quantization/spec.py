"""A checkpoint's `quantization_config` (config.json), read once into a typed spec.

The writers name the same facts differently: GPTQ (`bits`, `group_size`, `desc_act`, `sym`,
`checkpoint_format`/`format`), AutoAWQ (`bits`, `group_size`, `zero_point`, `version`), compressed-tensors
(`format` and `config_groups[*].weights`: `num_bits`, `type`, `symmetric`, `strategy`, `group_size`,
`actorder`; `input_activations`), and the fp8 block format (`weight_block_size`, `activation_scheme`; GPTQModel
adds `weight_scale_method`, `weight_scale_semantics`). Every field a producer writes is either read or refused
(FIELDS): one left unread could change what the tensors mean.
`scheme` is what the registry (engine/quantization/registry.py) dispatches on."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class QuantSpec:
    method: str  # quant_method: "gptq", "awq", "compressed-tensors", "fp8", or what else a writer named
    format: str  # gptq: "gptq" (v1) or "gptq_v2"; awq: its version ("gemm"); compressed-tensors: its format
    bits: int = 0  # of each weight (0: not given)
    weight_type: str = "int"  # "int" or "float"
    group_size: int = -1  # input channels per scale; -1: one scale per output channel over all of them
    symmetric: bool = True  # no zero point (compressed-tensors), or GPTQ's `sym` (zeros are still stored)
    desc_act: bool = False  # act order: g_idx maps each input channel to its group
    strategy: str | None = None  # compressed-tensors: "group", "channel", "tensor", "block"
    weight_block_size: tuple[int, int] | None = None  # fp8 block scales: [out rows, in columns] per scale
    activation_scheme: str | None = None  # fp8: "dynamic" or "static" activation scales
    activation_bits: int = 0  # quantized activations (compressed-tensors input_activations), 0: none
    inverse_scales: bool = False  # fp8 blocks: weight_scale_inv is a scale's inverse (GPTQModel's "inverse")
    ignore: tuple[str, ...] = ()  # modules the writer left unquantized (informative: tensors decide)
    raw: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def scheme(self) -> str:
        """The registry key: the method, and for compressed-tensors its format."""
        return f"{self.method}:{self.format}" if self.method == "compressed-tensors" else self.method

    def describe(self) -> str:
        """One line for /v1/state and the start-up log, e.g. "gptq w4 g128 asym act-order"."""
        if self.weight_type == "float":
            blocks = f" block {self.weight_block_size[0]}x{self.weight_block_size[1]}" if self.weight_block_size else ""
            strategy = f" {self.strategy}" if self.strategy else ""
            return f"{self.scheme} fp8{blocks}{strategy}"
        group = "channel" if self.group_size == -1 else f"g{self.group_size}"
        zeros = "sym" if self.symmetric else "asym"
        order = " act-order" if self.desc_act else ""
        return f"{self.scheme} w{self.bits} {group} {zeros}{order}"


def read_quant_spec(config: dict) -> QuantSpec | None:
    """The spec of config.json's `quantization_config`, None when there is none; ValueError when it cannot be
    read: a field this engine does not know, or a value of a field it reads that it does not serve, names the
    field (the registry refuses methods it does not serve, listing those it does)."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    method = str(quant.get("quant_method") or "").lower()
    if not method:
        raise ValueError("quantization_config has no quant_method")
    reader = _READERS.get(method)
    if reader is None:
        return QuantSpec(method=method, format="", raw=quant)
    check_fields(method, quant, FIELDS[method])
    return reader(quant)


# Every field the producers write in quantization_config, per method: "read" fields can change what the stored
# tensors mean and are read here (a value not served is refused, naming the field); "inert" ones cannot (how the
# producer calibrated, provenance, which kernel a runtime picks, which modules it left out: the tensors present
# decide that). A field in neither is refused: it might change the numbers, and ignoring it could serve a wrong
# model without a word. tests/engine/test_quant_spec_fields.py walks the producers' own field lists against these.
_GPTQMODEL_READ = {"quant_method", "method", "bits", "group_size", "desc_act", "format", "checkpoint_format",
                   "pack_dtype", "lm_head", "dynamic", "rotation", "is_marlin_format"}
_GPTQ_INERT = {  # GPTQModel's and transformers' (GPTQConfig, which AwqConfig extends) calibration and runtime
    "meta", "damp_percent", "damp_auto_increment", "true_sequential", "static_groups", "act_group_aware", "mse",
    "gptaq", "foem", "hessian", "mock_quantization", "v2", "v2_alpha", "preprocessors", "smoother", "smooth",
    "fallback", "offload_to_disk", "offload_to_disk_path", "tokenizer", "dataset", "backend", "use_exllama",
    "exllama_config", "use_cuda_fp16", "model_seqlen", "block_name_to_quantize", "module_name_preceding_first_block",
    "batch_size", "pad_token_id", "max_input_length", "cache_block_outputs", "modules_in_block_to_quantize",
    "model_name_or_path", "model_file_base_name", "quantizer", "modules_to_not_convert"}
FIELDS: dict[str, dict[str, frozenset[str]]] = {
    "gptq": {"read": frozenset(_GPTQMODEL_READ | {"sym"}), "inert": frozenset(_GPTQ_INERT)},
    "awq": {"read": frozenset(_GPTQMODEL_READ | {"zero_point", "version"}),
            # sym: transformers' AwqConfig writes GPTQ's default beside zero_point, which is what AWQ means
            "inert": frozenset(_GPTQ_INERT | {"sym"})},
    "fp8": {"read": frozenset(_GPTQMODEL_READ | {"sym", "fmt", "weight_block_size", "activation_scheme",
                                                 "weight_scale_method", "weight_scale_semantics", "scale_fmt",
                                                 "expert_dtype"}),
            # pack_dtype: nothing is packed; dequantize: transformers' load option; the module lists: tensors decide
            "inert": frozenset(_GPTQ_INERT | {"dequantize", "modules_to_convert", "ignored_layers"})},
    "compressed-tensors": {
        "read": frozenset({"quant_method", "format", "config_groups", "kv_cache_scheme", "sparsity_config",
                           "transform_config", "moe_sparsity_config"}),
        "inert": frozenset({"quantization_status", "ignore", "global_compression_ratio", "version"})},
    "compressed-tensors group": {  # each of config_groups' schemes
        "read": frozenset({"weights", "input_activations", "output_activations", "format"}),
        "inert": frozenset({"targets"})},
    "compressed-tensors args": {  # a scheme's weights and input_activations (QuantizationArgs)
        "read": frozenset({"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
                           "actorder", "scale_dtype", "zp_dtype"}),
        "inert": frozenset({"observer", "observer_kwargs"})},
}


def check_fields(where: str, fields: dict, known: dict[str, frozenset[str]]) -> None:
    unknown = sorted(set(fields) - known["read"] - known["inert"])
    if unknown:
        raise ValueError(f"quantization_config ({where}): field {unknown[0]!r} is not known to this engine, which "
                         f"refuses what it does not read rather than ignore something that may change the weights")


def refuse(field: str, value, served: str) -> ValueError:
    return ValueError(f"quantization_config {field} {value!r} is not served; served: {served}")


def _gptqmodel_common(quant: dict) -> None:
    """GPTQModel's fields beside the format's own: per-module overrides, a quantized lm_head, a rotation folded
    into the weights, words other than int32: none is served."""
    if quant.get("dynamic"):
        raise refuse("dynamic", quant["dynamic"], "none (no per-module overrides of the quantization)")
    if quant.get("lm_head"):
        raise refuse("lm_head", quant["lm_head"], "false (lm_head in full precision)")
    if quant.get("rotation"):
        raise refuse("rotation", quant["rotation"], "none")
    if quant.get("is_marlin_format"):
        raise refuse("is_marlin_format", quant["is_marlin_format"], "false")


def _one_format(quant: dict, names: tuple[str, ...], default: str) -> str:
    """The format named by whichever of `names` the writer set, lower case; two that disagree are refused."""
    given = {name: str(quant[name]).lower() for name in names if quant.get(name)}
    if len(set(given.values())) > 1:
        raise ValueError(f"quantization_config names two formats: {given}")
    return next(iter(given.values()), default)


def _packed_words(quant: dict) -> None:
    if quant.get("pack_dtype") not in (None, "int32"):
        raise refuse("pack_dtype", quant["pack_dtype"], "int32")


def _gptq(quant: dict) -> QuantSpec:
    _gptqmodel_common(quant)
    _packed_words(quant)
    return QuantSpec(method="gptq", format=_one_format(quant, ("checkpoint_format", "format"), "gptq"),
                     bits=int(quant.get("bits", 0)), group_size=int(quant.get("group_size", -1)),
                     symmetric=bool(quant.get("sym", True)), desc_act=bool(quant.get("desc_act", False)), raw=quant)


def _awq(quant: dict) -> QuantSpec:
    _gptqmodel_common(quant)
    _packed_words(quant)
    if quant.get("desc_act"):
        raise refuse("desc_act", quant["desc_act"], "false (AWQ has no act order)")
    return QuantSpec(method="awq", format=_one_format(quant, ("version", "format", "checkpoint_format"), "gemm"),
                     bits=int(quant.get("bits", 0)), group_size=int(quant.get("group_size", -1)),
                     symmetric=not quant.get("zero_point", True),
                     ignore=tuple(quant.get("modules_to_not_convert") or ()), raw=quant)


FP8_FORMATS = {"e4m3": "e4m3", "float8_e4m3fn": "e4m3", "float8_e4m3": "e4m3", "fp8": "e4m3"}  # the writers' names
SCALE_SEMANTICS = {None: False, "inverse": True}  # weight_scale_semantics -> the stored scale is an inverse


def _fp8(quant: dict) -> QuantSpec:
    _gptqmodel_common(quant)
    names = {name: str(quant[name]).lower() for name in ("fmt", "format", "checkpoint_format") if quant.get(name)}
    for name, value in names.items():
        if value not in FP8_FORMATS:
            raise refuse(name, quant[name], "e4m3 (float8_e4m3fn)")
    checks = {"bits": (quant.get("bits", 8), (8,)), "group_size": (quant.get("group_size", -1), (-1, None)),
              "desc_act": (quant.get("desc_act", False), (False, None)), "sym": (quant.get("sym", True), (True, None)),
              "scale_fmt": (quant.get("scale_fmt"), (None, "float")), "expert_dtype": (quant.get("expert_dtype"),
                                                                                         (None, "fp8"))}
    for name, (value, served) in checks.items():
        if value not in served:
            raise refuse(name, value, ", ".join(map(repr, [v for v in served if v is not None])))
    semantics = quant.get("weight_scale_semantics")
    if semantics not in SCALE_SEMANTICS:
        raise refuse("weight_scale_semantics", semantics, "'inverse' (the weight is weight / weight_scale_inv, "
                     "GPTQModel's) or none (the weight is weight * weight_scale_inv)")
    block = quant.get("weight_block_size")
    method = quant.get("weight_scale_method")
    if method not in (None, "block"):  # "row", "tensor": GPTQModel's scales per row or per tensor
        raise refuse("weight_scale_method", method, "'block' with weight_block_size [128, 128]")
    return QuantSpec(method="fp8", format="e4m3", bits=8, weight_type="float",
                     weight_block_size=tuple(block) if block else None,
                     activation_scheme=quant.get("activation_scheme"), inverse_scales=SCALE_SEMANTICS[semantics],
                     ignore=tuple(quant.get("modules_to_not_convert") or ()), raw=quant)


# compressed-tensors' ActivationOrdering: "weight" (and its alias "static") only orders the calibration, the
# stored format is unchanged (no g_idx); "group" (and its alias "dynamic", and the old `true`) stores g_idx.
IN_ORDER_ACTORDERS = (None, False, "weight", "static")
ACT_ORDER_ACTORDERS = (True, "group", "dynamic")


def _ct_args(args: dict | None, where: str) -> dict:
    if args is None:
        return {}
    check_fields(where, args, FIELDS["compressed-tensors args"])
    if args.get("scale_dtype") not in (None, "torch.float16", "torch.bfloat16", "torch.float32"):
        raise refuse(f"{where} scale_dtype", args["scale_dtype"], "float16, bfloat16, float32")
    if args.get("zp_dtype") not in (None, "torch.int8", "torch.int32", "torch.float8_e4m3fn", "torch.float16",
                                    "torch.bfloat16", "torch.float32"):
        raise refuse(f"{where} zp_dtype", args["zp_dtype"], "an integer or float dtype")
    actorder = args.get("actorder")
    if actorder not in IN_ORDER_ACTORDERS + ACT_ORDER_ACTORDERS:
        raise refuse(f"{where} actorder", actorder, "null, 'weight', 'static', 'group', 'dynamic'")
    return args


def _compressed_tensors(quant: dict) -> QuantSpec:
    for name in ("kv_cache_scheme", "transform_config", "moe_sparsity_config"):
        if quant.get(name):
            raise refuse(name, quant[name], "none")
    sparsity = quant.get("sparsity_config")
    if sparsity and str(sparsity.get("format", "dense")).lower() != "dense":
        raise refuse("sparsity_config", sparsity, "none, or format 'dense'")
    groups = quant.get("config_groups") or {}
    for name, group in groups.items():
        check_fields(f"config_groups.{name}", group, FIELDS["compressed-tensors group"])
        if group.get("output_activations"):
            raise refuse(f"config_groups.{name}.output_activations", group["output_activations"], "none")
    schemes = {repr((g.get("weights"), g.get("input_activations"), g.get("format"))) for g in groups.values()}
    if len(schemes) != 1:
        raise ValueError(f"compressed-tensors: {len(groups)} config_groups with {len(schemes)} different schemes; "
                         f"one scheme for every quantized module is supported")
    name, group = next(iter(groups.items()))
    weights = _ct_args(group.get("weights"), f"config_groups.{name}.weights")
    acts = _ct_args(group.get("input_activations"), f"config_groups.{name}.input_activations")
    if weights.get("dynamic"):
        raise refuse(f"config_groups.{name}.weights dynamic", weights["dynamic"], "false (stored scales)")
    if acts.get("actorder") not in (None, False):
        raise refuse(f"config_groups.{name}.input_activations actorder", acts["actorder"], "null")
    block = weights.get("block_structure")
    formats = {str(f).lower() for f in (group.get("format"), quant.get("format")) if f} - {"mixed-precision"}
    if len(formats) > 1:  # the top-level format is the groups' one, or "mixed-precision" when they differ
        raise ValueError(f"quantization_config names two formats: format {quant.get('format')!r}, "
                         f"config_groups.{name}.format {group.get('format')!r}")
    return QuantSpec(
        method="compressed-tensors", format=next(iter(formats), ""),
        bits=int(weights.get("num_bits", 0)), weight_type=str(weights.get("type", "int")),
        group_size=int(weights.get("group_size") or -1), symmetric=bool(weights.get("symmetric", True)),
        desc_act=weights.get("actorder") in ACT_ORDER_ACTORDERS, strategy=weights.get("strategy"),
        weight_block_size=tuple(block) if block else None,
        activation_scheme=("dynamic" if acts.get("dynamic") else "static") if acts else None,
        activation_bits=int(acts.get("num_bits", 0)) if acts else 0,
        ignore=tuple(quant.get("ignore") or ()), raw=quant)


_READERS = {"gptq": _gptq, "awq": _awq, "fp8": _fp8, "compressed-tensors": _compressed_tensors}


def activation_mode(spec: QuantSpec) -> str | None:
    """compressed-tensors' input activations: None (weight-only), "token" (dynamic per token) or "tensor"
    (static per tensor); anything else as its strategy name, which check_spec refuses."""
    if not spec.activation_bits:
        return None
    acts = input_activations(spec)
    strategy = acts.get("strategy")
    if (acts.get("type", "float") != "float" or (strategy == "token") != bool(acts.get("dynamic"))
            or not acts.get("symmetric", True)):
        return f"{acts.get('type')} {strategy} dynamic={acts.get('dynamic')} symmetric={acts.get('symmetric')}"
    return strategy


def weight_args(spec: QuantSpec) -> dict:
    """The weights of compressed-tensors' one config group (_compressed_tensors reads one)."""
    groups = spec.raw.get("config_groups") or {}
    return next(iter(groups.values()), {}).get("weights") or {}


def input_activations(spec: QuantSpec) -> dict:
    """The input_activations of compressed-tensors' one config group (_compressed_tensors reads one)."""
    groups = spec.raw.get("config_groups") or {}
    return next(iter(groups.values()), {}).get("input_activations") or {}
