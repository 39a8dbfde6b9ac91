"""Adapters saved before transformers 5, one LoRA per expert module (`mlp.experts.{e}.gate_proj`; Mixtral's
`block_sparse_moe.experts.{e}.w1`), in the stacked layout PEFT converts them to when it loads them on a
transformers 5 model (peft.utils.transformers_weight_conversion): the projections' names become target_parameters
on the stacked experts, gate and up fused at twice the rank and alpha (A: gate's rows then up's, B: block
diagonal), every expert's rows stacked along the rank (lora_A [E*r, in], lora_B [out, E*r], column j*E + e)."""

import dataclasses
import re

import torch

from adapters.base_shapes import BaseShapes
from adapters.errors import AdapterError
from adapters.peft_config import LoraSettings
from adapters.safetensors_check import TensorEntry
from adapters.tensor_names import expert_tensor_name

_PER_EXPERT = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)"
    r"\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.(?P<half>lora_A|lora_B)(?:\.weight)?$"
)
_PROJECTION = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj", "w1": "gate_proj",
               "w3": "up_proj", "w2": "down_proj"}
_MODULE = {"gate_proj": "experts_gate_up_proj", "up_proj": "experts_gate_up_proj", "down_proj": "experts_down_proj"}


def stacked_experts(settings: LoraSettings, entries: dict[str, TensorEntry], shapes: BaseShapes):
    """(settings, entries, convert) with any per-expert LoRA tensors replaced by the stacked ones PEFT makes of
    them; `convert` does the same to the tensors once read. Unchanged (convert: identity) without such tensors.
    AdapterError when PEFT could not convert them either, or Quilt would serve them otherwise than PEFT."""
    found = {name: _PER_EXPERT.match(name.removesuffix(".weight") + ".weight") for name in entries}
    found = {name: (int(m["layer"]), int(m["expert"]), _PROJECTION[m["proj"]], m["half"])
             for name, m in found.items() if m is not None}
    if not found:
        return settings, entries, lambda tensors: tensors
    if not shapes.family.experts or shapes.model_type == "qwen2_moe":
        raise AdapterError("unsupported_module", f"the adapter has one LoRA per expert module (saved before "
                           f"transformers 5), which is served on Qwen3-MoE and Mixtral bases, not on "
                           f"{shapes.family.describe()}")
    if not isinstance(settings.target_modules, list) or settings.layers_to_transform is not None:
        raise AdapterError("unsupported_option", "an adapter with one LoRA per expert module (saved before "
                           "transformers 5) is served when target_modules is a list and layers_to_transform unset")
    layers = sorted({layer for layer, _, _, _ in found.values()})
    projections = {proj for _, _, proj, _ in found.values()}
    if ("gate_proj" in projections) != ("up_proj" in projections):
        raise AdapterError("unsupported_module", "the experts' gate and up projections are one stacked parameter "
                           "(gate_up_proj) in transformers 5: an adapter on one of them needs the other too")
    expected = {(layer, expert, proj, half) for layer in layers for expert in range(shapes.num_experts)
                for proj in projections for half in ("lora_A", "lora_B")}
    if set(found.values()) != expected or set(layers) != set(shapes.expert_layers):
        raise AdapterError("tensor_missing", "an adapter with one LoRA per expert module needs both halves of every "
                           f"targeted projection of all {shapes.num_experts} experts in every MoE layer")
    rank = settings.r
    for name, (_, _, _, half) in found.items():
        if entries[name].shape[0 if half == "lora_A" else -1] != rank:
            raise AdapterError("tensor_shape", f"tensor {name} is not of rank r={rank}; per-expert adapters are "
                               "served at the config's one rank")
    modules = sorted({_MODULE[proj] for proj in projections})
    targets = {"gate_up_proj"} if "experts_gate_up_proj" in modules else set()
    targets |= {"down_proj"} if "experts_down_proj" in modules else set()
    converted = dataclasses.replace(
        settings,
        target_modules=[t for t in settings.target_modules if not any(
            t == old or t.endswith(f".{old}") for old in _PROJECTION)],
        target_parameters=sorted(set(settings.target_parameters) | targets),
        rank_pattern={**settings.rank_pattern, **({r".*\.gate_up_proj": 2 * rank} if targets >= {"gate_up_proj"}
                                                  else {})},
        alpha_pattern={**settings.alpha_pattern, **({r".*\.gate_up_proj": 2 * settings.lora_alpha}
                                                    if targets >= {"gate_up_proj"} else {})},
    )
    dtype = next(entries[name].dtype for name in found)
    new_entries = {name: entry for name, entry in entries.items() if name not in found}
    widths = {m: shapes.lora_shapes(m, 2 * rank if m == "experts_gate_up_proj" else rank) for m in modules}
    targeted = tuple(m for m in ("experts_gate_up_proj", "experts_down_proj") if m in modules)
    for layer in layers:
        for module in modules:
            for half, shape in zip(("lora_A", "lora_B"), widths[module], strict=True):
                new_entries[expert_tensor_name(layer, module, half, targeted)] = TensorEntry(dtype, shape, 0, 0)

    def convert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        by_key = {found[name]: tensor for name, tensor in tensors.items() if name in found}
        out = {name: tensor for name, tensor in tensors.items() if name not in found}
        for layer in layers:
            for module in modules:
                projs = ("gate_proj", "up_proj") if module == "experts_gate_up_proj" else ("down_proj",)
                a = torch.cat([torch.cat([by_key[(layer, e, p, "lora_A")] for p in projs])  # [S*r, in] per expert
                               for e in range(shapes.num_experts)])  # [E*S*r, in]
                b = torch.stack([torch.block_diag(*[by_key[(layer, e, p, "lora_B")] for p in projs])
                                 for e in range(shapes.num_experts)], dim=-1)  # [out, S*r, E]
                out[expert_tensor_name(layer, module, "lora_A", targeted)] = a.contiguous()
                out[expert_tensor_name(layer, module, "lora_B", targeted)] = b.reshape(b.shape[0], -1).contiguous()
        return out

    return converted, new_entries, convert
