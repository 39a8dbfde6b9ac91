"""PEFT's tensor names, mapped to Quilt's canonical `layers.{i}.{module}.lora_A|lora_B`."""

import re
from dataclasses import dataclass

from adapters.base_shapes import ALL_MODULES, EXPERT_MODULES, Family, module_parent
from adapters.errors import AdapterError

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight, also without the `base_model.model.`
# wrapper or the `.weight` suffix, and with the adapter name PEFT keeps in memory (`lora_A.default.weight`).
_LORA_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(?P<layer>\d+)\.(?P<parent>[A-Za-z_]+(?:\.shared_expert)?)"
    r"\.(?P<module>[A-Za-z_]+)"
    r"\.(?P<half>lora_A|lora_B)(?:\.(?P<adapter>[\w-]+))?$"
)

# The experts' stacked parameters: PEFT wraps each targeted one in a ParamWrapper around the experts module,
# nested in the order the module registers them (gate_up_proj, then down_proj), so the first targeted is the
# innermost: base_model.model.model.layers.3.mlp.experts[.base_layer]*.lora_A.weight
_EXPERT_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<wrap>(?:base_layer\.)*)"
    r"(?P<half>lora_A|lora_B)(?:\.(?P<adapter>[\w-]+))?$"
)


@dataclass(frozen=True)
class LoraTensorName:
    layer: int
    module: str
    half: str  # "lora_A" | "lora_B"
    adapter_name: str | None

    @property
    def canonical(self) -> str:
        return canonical_name(self.layer, self.module, self.half)

    @property
    def where(self) -> str:
        return f"layer {self.layer} {self.module}"


def canonical_name(layer: int, module: str, half: str) -> str:
    return f"layers.{layer}.{module}.{half}"


def module_name(layer: int, module: str) -> str:
    return f"layers.{layer}.{module}"


def experts_by_layer(modules) -> dict[int, tuple[str, ...]]:
    """Per layer, the expert modules among `modules` ("layers.{i}.{module}"), in EXPERT_MODULES order."""
    found = set()
    for name in modules:
        _, layer, module = name.split(".")
        found.add((int(layer), module))
    layers = {layer for layer, module in found if module in EXPERT_MODULES}
    return {layer: tuple(m for m in EXPERT_MODULES if (layer, m) in found) for layer in layers}


def expert_tensor_name(layer: int, module: str, half: str, targeted: tuple[str, ...]) -> str:
    """PEFT's name of an expert module's lora_A / lora_B, `targeted` being the layer's expert modules the adapter
    adapts (EXPERT_MODULES order)."""
    depth = len(targeted) - 1 - targeted.index(module)
    return f"base_model.model.model.layers.{layer}.mlp.experts.{'base_layer.' * depth}{half}.weight"


def parse_tensor_name(name: str, family: Family | None = None,
                      experts: dict[int, tuple[str, ...]] | None = None) -> LoraTensorName:
    """Map one saved tensor name to the module it adapts, or refuse it with the reason; with `family`, a
    module that family's base does not have is refused by name. `experts`: per layer, the expert modules the
    adapter targets (EXPERT_MODULES order), which tells PEFT's nested expert wrappers apart."""
    _refuse_unserved(name)
    expert = _EXPERT_NAME.match(name.removesuffix(".weight"))
    if expert is not None:
        return _expert_name(name, expert, family, experts or {})
    match = _LORA_NAME.match(name.removesuffix(".weight"))
    if match is None:
        raise AdapterError("tensor_unknown", f"tensor {name} is not a LoRA weight of a decoder layer's projection")
    module = match["module"]
    if match["parent"] == "mlp.shared_expert":  # Qwen2-MoE's shared expert
        module = f"shared_expert_{module}"
    elif match["parent"] == "mlp" and module == "gate":  # an MoE layer's router (PEFT: target_parameters gate.weight)
        module = "router"
    if family is not None and module not in family.servable:
        raise family.missing_module(module, where=f"tensor {name} adapts")
    if module not in ALL_MODULES or match["parent"] != module_parent(module):
        raise AdapterError(
            "tensor_unknown",
            f"tensor {name} adapts {match['parent']}.{module}; only {', '.join(ALL_MODULES)} can carry a LoRA",
        )
    return LoraTensorName(
        layer=int(match["layer"]), module=module, half=match["half"], adapter_name=match["adapter"]
    )


def _expert_name(name: str, match: re.Match, family: Family | None,
                 experts: dict[int, tuple[str, ...]]) -> LoraTensorName:
    if family is not None and not family.experts:
        raise family.missing_module("experts", where=f"tensor {name} adapts")
    layer, depth = int(match["layer"]), match["wrap"].count("base_layer.")
    targeted = experts.get(layer, ())
    if depth >= len(targeted):
        raise AdapterError(
            "tensor_unknown",
            f"tensor {name} adapts layer {layer}'s experts, which adapter_config.json's target_parameters "
            f"{'do not target there' if not targeted else f'target only as {len(targeted)} parameter(s)'}",
        )
    module = targeted[len(targeted) - 1 - depth]
    assert module in EXPERT_MODULES
    return LoraTensorName(layer=layer, module=module, half=match["half"], adapter_name=match["adapter"])


def _refuse_unserved(name: str) -> None:
    if "modules_to_save" in name:
        raise AdapterError(
            "modules_to_save_unsupported",
            f"tensor {name} is a fully retrained module; that is not served yet",
        )
    if "lora_magnitude_vector" in name:
        raise AdapterError(
            "dora_unsupported", f"tensor {name} is a DoRA magnitude; DoRA adapters are not served yet"
        )
    if "lora_embedding_A" in name or "lora_embedding_B" in name or "embed_tokens" in name:
        raise AdapterError(
            "embedding_unsupported", f"tensor {name} adapts the embeddings; that is not served yet"
        )
    if "lm_head" in name:
        raise AdapterError("lm_head_unsupported", f"tensor {name} adapts lm_head; that is not served yet")
    if name.endswith(".bias"):
        raise AdapterError(
            "bias_unsupported", f"tensor {name} is a bias; adapters that train biases are not served yet"
        )
