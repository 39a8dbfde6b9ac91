"""A checkpoint's `quantization_config` (config.json), read once into a typed spec.

The writers name the same facts differently: GPTQ (`bits`, `group_size`, `desc_act`, `sym`,
`checkpoint_format`/`format`), AutoAWQ (`bits`, `group_size`, `zero_point`, `version`), compressed-tensors
(`format` and `config_groups[*].weights`: `num_bits`, `type`, `symmetric`, `strategy`, `group_size`,
`actorder`; `input_activations`), and the fp8 block format (`weight_block_size`, `activation_scheme`).
`scheme` is what the registry (engine/quant_formats/registry.py) dispatches on."""

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
    read (the registry refuses methods it does not serve, listing those it does)."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    method = str(quant.get("quant_method") or "").lower()
    if not method:
        raise ValueError("quantization_config has no quant_method")
    reader = _READERS.get(method)
    return reader(quant) if reader is not None else QuantSpec(method=method, format="", raw=quant)


def _gptq(quant: dict) -> QuantSpec:
    fmt = str(quant.get("checkpoint_format") or quant.get("format") or "gptq").lower()
    return QuantSpec(method="gptq", format=fmt, bits=int(quant.get("bits", 0)),
                     group_size=int(quant.get("group_size", -1)), symmetric=bool(quant.get("sym", True)),
                     desc_act=bool(quant.get("desc_act", False)), raw=quant)


def _awq(quant: dict) -> QuantSpec:
    return QuantSpec(method="awq", format=str(quant.get("version") or "gemm").lower(), bits=int(quant.get("bits", 0)),
                     group_size=int(quant.get("group_size", -1)), symmetric=not quant.get("zero_point", True),
                     ignore=tuple(quant.get("modules_to_not_convert") or ()), raw=quant)


def _fp8(quant: dict) -> QuantSpec:
    block = quant.get("weight_block_size")
    return QuantSpec(method="fp8", format=str(quant.get("fmt") or "e4m3"), bits=8, weight_type="float",
                     weight_block_size=tuple(block) if block else None,
                     activation_scheme=quant.get("activation_scheme"),
                     ignore=tuple(quant.get("modules_to_not_convert") or ()), raw=quant)


def _compressed_tensors(quant: dict) -> QuantSpec:
    groups = quant.get("config_groups") or {}
    schemes = {repr((g.get("weights"), g.get("input_activations"), g.get("format"))) for g in groups.values()}
    if len(schemes) != 1:
        raise ValueError(f"compressed-tensors: {len(groups)} config_groups with {len(schemes)} different schemes; "
                         f"one scheme for every quantized module is supported")
    group = next(iter(groups.values()))
    weights = group.get("weights") or {}
    acts = group.get("input_activations") or {}
    actorder = weights.get("actorder")
    block = weights.get("block_structure")
    return QuantSpec(
        method="compressed-tensors", format=str(group.get("format") or quant.get("format") or "").lower(),
        bits=int(weights.get("num_bits", 0)), weight_type=str(weights.get("type", "int")),
        group_size=int(weights.get("group_size") or -1), symmetric=bool(weights.get("symmetric", True)),
        desc_act=actorder not in (None, False), strategy=weights.get("strategy"),
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
    if acts.get("type", "float") != "float" or (strategy == "token") != bool(acts.get("dynamic")):
        return f"{acts.get('type')} {strategy} dynamic={acts.get('dynamic')}"
    return strategy


def input_activations(spec: QuantSpec) -> dict:
    """The input_activations of compressed-tensors' one config group (_compressed_tensors reads one)."""
    groups = spec.raw.get("config_groups") or {}
    return next(iter(groups.values()), {}).get("input_activations") or {}
