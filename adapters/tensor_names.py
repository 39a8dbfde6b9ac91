"""PEFT's tensor names, mapped to Quilt's canonical `layers.{i}.{module}.lora_A|lora_B`."""

import re
from dataclasses import dataclass

from adapters.base_shapes import ALL_MODULES, Family, module_parent
from adapters.errors import AdapterError

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight, also without the `base_model.model.`
# wrapper or the `.weight` suffix, and with the adapter name PEFT keeps in memory (`lora_A.default.weight`).
_LORA_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(?P<layer>\d+)\.(?P<parent>[A-Za-z_]+)\.(?P<module>[A-Za-z_]+)"
    r"\.(?P<half>lora_A|lora_B)(?:\.(?P<adapter>[\w-]+))?$"
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


def parse_tensor_name(name: str, family: Family | None = None) -> LoraTensorName:
    """Map one saved tensor name to the module it adapts, or refuse it with the reason; with `family`, a
    module that family's base does not have is refused by name."""
    _refuse_unserved(name)
    match = _LORA_NAME.match(name.removesuffix(".weight"))
    if match is None:
        raise AdapterError("tensor_unknown", f"tensor {name} is not a LoRA weight of a decoder layer's projection")
    module = match["module"]
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
