"""load_adapter: from what a tenant uploaded to a validated LoadedAdapter, or a clear refusal."""

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adapters.archive import ArchiveLimits, unpacked
from adapters.base_shapes import ALL_MODULES, BaseShapes, fused_of
from adapters.errors import AdapterError
from adapters.expert_layout import stacked_experts
from adapters.layout import PICKLE_SUFFIXES, find_adapter_files
from adapters.loaded import LoadedAdapter
from adapters.peft_config import MAX_CONFIG_BYTES, LoraSettings
from adapters.safetensors_check import TensorEntry, check_safetensors, read_tensors
from adapters.tensor_names import LoraTensorName, experts_by_layer, module_name, parse_tensor_name

DEFAULT_MAX_RANK = 256
PATTERN_SECONDS = 30.0  # matching is bounded per pattern (pattern_guard); this bounds the sum


@dataclass(frozen=True)
class PlannedModule:
    key: str  # the module's name as PEFT matched it, "model.layers.3.self_attn.v_proj"
    rank: int
    alpha: float


def load_adapter(
    source: str | Path,
    base_config: dict[str, Any],
    *,
    max_rank: int = DEFAULT_MAX_RANK,
    limits: ArchiveLimits | None = None,
) -> LoadedAdapter:
    """Validate and load a PEFT LoRA adapter (a folder, .zip, .tar or .tar.gz) for the given base model.

    Raises AdapterError with a `code` and a message for the tenant when anything is off; an archive is
    unpacked into a temporary directory that is removed before this returns or raises.
    """
    shapes = BaseShapes.from_config(base_config)
    source = Path(source)
    if not source.exists():
        raise AdapterError("source_missing", f"{source.name} does not exist")
    if source.is_file() and source.name.lower().endswith(PICKLE_SUFFIXES):
        raise AdapterError(
            "pickle_file",
            f"{source.name} is a pickle file: loading it can run code, so Quilt refuses it. "
            "Save the adapter with safetensors (save_pretrained's default) and upload its folder",
        )
    with unpacked(source, limits=limits or ArchiveLimits()) as root:
        files = find_adapter_files(root)
        if files.config.stat().st_size > MAX_CONFIG_BYTES:
            raise AdapterError(
                "config_invalid", f"adapter_config.json is larger than {MAX_CONFIG_BYTES} bytes"
            )
        settings = LoraSettings.from_json(files.config.read_bytes())
        settings, entries, stack = stacked_experts(settings, check_safetensors(files.weights), shapes)
        plan, names = _check_against(settings, entries, shapes, max_rank=max_rank)
        loaded = stack(read_tensors(files.weights))
    tensors = {names[key].canonical: tensor for key, tensor in loaded.items()}
    for key, tensor in tensors.items():
        _check_finite(key, tensor)
    return LoadedAdapter.build(
        tensors=tensors,
        ranks={name: module.rank for name, module in plan.items()},
        alphas={name: module.alpha for name, module in plan.items()},
        scaling={name: settings.scaling(module.alpha, module.rank) for name, module in plan.items()},
        alpha=settings.lora_alpha,
        use_rslora=settings.use_rslora,
        base_model_name_or_path=settings.base_model_name_or_path,
    )


def check_modules_against_base(
    settings: LoraSettings, entries: dict[str, TensorEntry], base_config: dict[str, Any]
) -> None:
    """The checks of the modules' names, which need the base model's family but only the safetensors header:
    every module the adapter targets exists in the base's family and every tensor belongs to one of them
    (AdapterError naming the module and the family if not). Shapes and values are load_adapter's."""
    shapes = BaseShapes.from_config(base_config)
    settings, entries, _ = stacked_experts(settings, entries, shapes)
    _match_tensors(entries, _planned_modules(settings, shapes, deadline=time.monotonic() + PATTERN_SECONDS), shapes)


def _check_against(
    settings: LoraSettings, entries: dict[str, TensorEntry], shapes: BaseShapes, *, max_rank: int
) -> tuple[dict[str, PlannedModule], dict[str, LoraTensorName]]:
    plan = _planned_modules(settings, shapes, deadline=time.monotonic() + PATTERN_SECONDS)
    names = _match_tensors(entries, plan, shapes)
    _check_shapes(entries, names, plan, shapes, max_rank=max_rank)
    return plan, names


def _check_finite(name: str, tensor: torch.Tensor) -> None:
    # a finite sum proves every element finite (NaN and Inf propagate); only an overflow needs the full check
    if torch.isfinite(tensor.sum(dtype=torch.float32)) or torch.isfinite(tensor).all():
        return
    counts = {"NaN": int(torch.isnan(tensor).sum()), "infinite": int(torch.isinf(tensor).sum())}
    found = " and ".join(f"{count} {kind}" for kind, count in counts.items() if count)
    _, layer, module, half = name.split(".")
    raise AdapterError(
        "tensor_not_finite",
        f"layer {layer} {module}: {half} contains {found} value(s); the training run likely diverged",
    )


def _layer_of(key: str) -> int:
    """The decoder layer of a PEFT module key ("model.layers.3.mlp.up_proj", "model.language_model.layers.3...")."""
    return int(re.search(r"\.layers\.(\d+)\.", key).group(1))


def _planned_modules(
    settings: LoraSettings, shapes: BaseShapes, *, deadline: float
) -> dict[str, PlannedModule]:
    """The modules PEFT would wrap for this config, keyed "layers.{i}.{module}", with their rank and alpha.

    On Phi-3 the split names (q_proj, ..., up_proj) are matched too, for adapters trained on a split copy of
    the model; where the config also matches the fused projection of that layer, the fused one is planned,
    as PEFT on the real model would, and "all-linear" means the real model's linear layers only."""
    family = shapes.family
    named = shapes.named_modules()
    aliases = shapes.split_alias_modules()
    if isinstance(settings.target_modules, list):
        keys = [*named, *aliases]
        for target in settings.target_modules:
            if not any(key == target or key.endswith(f".{target}") for key in keys):
                raise family.missing_module(target, where="target_modules names")
    plan = {}
    for key, kind in named.items():
        _check_deadline(deadline)
        if not settings.targets(key):
            continue
        if kind == "embedding":
            raise AdapterError(
                "embedding_unsupported",
                "target_modules includes the embeddings (embed_tokens); not served yet",
            )
        if kind == "lm_head":
            raise AdapterError(
                "lm_head_unsupported", "target_modules includes lm_head; LoRA on lm_head is not served yet"
            )
        if kind not in family.servable:
            raise AdapterError(
                "unsupported_module",
                f"target_modules matches {repr(key) if key else 'the root module'} ({kind}) of {family.describe()}; "
                f"LoRA is served on {family.served_list()} only",
            )
        layer = _layer_of(key)
        plan[module_name(layer, kind)] = PlannedModule(key, settings.rank_for(key), settings.alpha_for(key))
    if settings.target_modules != "all-linear":
        for key, split in aliases.items():
            _check_deadline(deadline)
            layer = _layer_of(key)
            if settings.targets(key) and module_name(layer, fused_of(split)) not in plan:
                plan[module_name(layer, split)] = PlannedModule(key, settings.rank_for(key), settings.alpha_for(key))
    plan |= _planned_experts(settings, shapes)
    if not plan:
        raise AdapterError(
            "no_target_modules",
            f"target_modules {settings.target_modules!r} matches none of the projections of {family.describe()} "
            f"({family.served_list()})",
        )
    return plan


def _planned_experts(settings: LoraSettings, shapes: BaseShapes) -> dict[str, PlannedModule]:
    """The parameters target_parameters names, as PEFT matches them (a name or a dotted suffix of
    `model.layers.{i}.mlp.experts.{gate_up_proj,down_proj}` or of the router's `model.layers.{i}.mlp.gate.weight`),
    with their rank (each expert's) and alpha."""
    family, keys = shapes.family, shapes.expert_parameters()
    for target in settings.target_parameters:
        if not family.experts:
            raise AdapterError(
                "unsupported_module",
                f"target_parameters names {target!r}, but {family.describe()} has no experts; LoRA on parameters is "
                "served on the experts of mixture-of-experts bases only (use target_modules)",
            )
        if not any(key == target or key.endswith(f".{target}") for key in keys):
            raise AdapterError(
                "unsupported_module",
                f"target_parameters names {target!r}, which is none of the parameters of {family.describe()} that "
                "LoRA is served on through target_parameters (mlp.experts.gate_up_proj, mlp.experts.down_proj, the "
                "router's mlp.gate.weight)",
            )
    plan = {}
    for key, module in keys.items():
        if settings.targets_parameter(key):
            layer = _layer_of(key)
            plan[module_name(layer, module)] = PlannedModule(key, settings.rank_for(key), settings.alpha_for(key))
    return plan


def _check_deadline(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise AdapterError(
            "config_too_complex", "adapter_config.json's patterns take too long to match; simplify them"
        )


def _match_tensors(
    entries: dict[str, TensorEntry], plan: dict[str, PlannedModule], shapes: BaseShapes
) -> dict[str, LoraTensorName]:
    """Every saved tensor belongs to a planned module, and every planned module has both halves."""
    experts = experts_by_layer(plan)
    names = {key: parse_tensor_name(key, shapes.family, experts) for key in entries}
    adapter_names = {name.adapter_name for name in names.values()}
    if len(adapter_names) > 1:
        raise AdapterError(
            "multiple_adapters",
            f"the weights mix several adapter names ({', '.join(sorted(map(str, adapter_names)))}); upload one adapter",
        )
    seen: dict[str, set[str]] = {}
    for key, name in names.items():
        if name.layer >= shapes.num_layers:
            raise AdapterError(
                "tensor_unknown",
                f"tensor {key} is for layer {name.layer}, but the base model has {shapes.num_layers} layers",
            )
        module = module_name(name.layer, name.module)
        fused = fused_of(name.module)
        if module not in plan and fused is not None and module_name(name.layer, fused) in plan:
            raise AdapterError(
                "module_conflict",
                f"tensor {key} adapts layer {name.layer} {name.module}, but the adapter also targets that "
                f"layer's fused {fused}; use either the fused or the split names",
            )
        if module not in plan:
            raise AdapterError(
                "tensor_unknown",
                f"tensor {key} adapts {name.where}, which adapter_config.json does not target",
            )
        halves = seen.setdefault(module, set())
        if name.half in halves:
            raise AdapterError("tensor_duplicate", f"{name.where}: {name.half} is stored twice")
        halves.add(name.half)
    for module, halves in seen.items():
        if len(halves) == 1:
            (have,) = halves
            other = "lora_B" if have == "lora_A" else "lora_A"
            raise AdapterError(
                "tensor_unpaired", f"{_where(module)}: {have} is present but {other} is missing"
            )
    missing = sorted(set(plan) - set(seen), key=_module_order)
    if missing:
        listed = ", ".join(_where(module) for module in missing[:4]) + (" ..." if len(missing) > 4 else "")
        raise AdapterError(
            "tensor_missing",
            f"adapter_config.json targets {len(missing)} module(s) with no weights in the file: {listed}",
        )
    return names


def _check_shapes(
    entries: dict[str, TensorEntry],
    names: dict[str, LoraTensorName],
    plan: dict[str, PlannedModule],
    shapes: BaseShapes,
    *,
    max_rank: int,
) -> None:
    """Shapes from the header against the base model and the ranks the config gives each module."""
    by_half = {(module_name(n.layer, n.module), n.half): entries[key] for key, n in names.items()}
    for module in sorted({module for module, _ in by_half}, key=_module_order):
        kind = module.split(".")[2]
        where = _where(module)
        rank = plan[module].rank
        if rank > max_rank:
            raise AdapterError(
                "rank_too_large", f"{where} has rank {rank}; this deployment serves ranks up to {max_rank}"
            )
        expected_a, expected_b = shapes.lora_shapes(kind, rank)
        for half, expected in (("lora_A", expected_a), ("lora_B", expected_b)):
            actual = by_half[(module, half)].shape
            if actual != expected:
                raise AdapterError(
                    "tensor_shape",
                    f"{where}: {half} has shape {list(actual)}, expected {list(expected)} for this base model"
                    + (f" and r={rank}" if _rank_of(half, actual) != rank else ""),
                )


def _rank_of(half: str, shape: tuple[int, ...]) -> int | None:
    if len(shape) != 2:
        return None
    return shape[0] if half == "lora_A" else shape[1]


def _module_order(module: str) -> tuple[int, int]:
    _, layer, kind = module.split(".")
    return int(layer), ALL_MODULES.index(kind)


def _where(module: str) -> str:
    _, layer, kind = module.split(".")
    return f"layer {layer} {kind}"
