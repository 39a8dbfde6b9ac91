"""Putting a pre-quantized checkpoint's modules (engine/quantization) into a model built on meta, before any tensor
is read, and finishing them once every tensor is in (engine/models/loader.py calls both).

A format's stacked experts know their weights, their loading and their grouped products, not the model: each is
served here as an Experts (the routing, the expert-sorted rows and the LoRA hooks around its `project`)."""

import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.lora_modules import PACKED_MODULES
from engine.models.causal_lm import CausalLM
from engine.models.linear import Linear
from engine.models.moe import Experts
from engine.parallel.sharding import ROW_PARALLEL
from engine.quantization.compressed_fp8_experts import CompressedFp8Experts
from engine.quantization.experts import PackedExperts
from engine.quantization.fp8_experts import Fp8Experts
from engine.quantization.packed_linear import SAFETENSORS_DTYPES, PackedLinear
from engine.quantization.registry import format_for
from engine.quantization.spec import QuantSpec


class PackedMoEExperts(PackedExperts, Experts):
    """An integer format's experts (GPTQ, AWQ, compressed-tensors) in an MoE layer."""


class Fp8MoEExperts(Fp8Experts, Experts):
    """The fp8 block format's experts in an MoE layer."""


class CompressedFp8MoEExperts(CompressedFp8Experts, Experts):
    """compressed-tensors float-quantized experts in an MoE layer."""


AS_EXPERTS: dict[type[nn.Module], type[Experts]] = {PackedExperts: PackedMoEExperts, Fp8Experts: Fp8MoEExperts,
                                                    CompressedFp8Experts: CompressedFp8MoEExperts}

_EXPERT = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)\.(\d+)$")  # MoECausalLM.checkpoint_target's


def _stored_kinds(model: CausalLM, files: list[Path]):
    """({target module: {stored kind: dtype}}, {target module: its checkpoint tensor names}, {target module: the
    names of its tensors stored fused, as one for every slice}) from the headers."""
    stored: dict[str, dict[str, torch.dtype]] = {}
    names: dict[str, list[str]] = {}
    fused: dict[str, set[str]] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for raw in f.keys():
                view = f.get_slice(raw)
                stored_kind = raw.rpartition(".")[2] not in ("weight", "bias")
                try:
                    split = model.checkpoint_parts(raw, tuple(view.get_shape()))  # Mixtral's w1/w2/w3, fused qkv
                    stored_fused = split is not None and len(split) > 1 and len(split[0]) == 3  # 2-D, several
                except ValueError:  # a fused tensor's rows checked as a weight's (qkv_proj.qweight [in / 8, out])
                    if not stored_kind:
                        raise
                    split, stored_fused = None, True
                if stored_fused:  # Phi-3's qkv_proj: the model's fused projection has the checkpoint's name
                    fused.setdefault(model.checkpoint_target(raw)[0], set()).add(raw)
                    split = None if stored_kind else split
                for name in [part[0] for part in split] if split else [raw]:
                    target = model.checkpoint_target(name)
                    if target is None:
                        continue
                    kind = name.rpartition(".")[2]
                    stored.setdefault(target[0], {}).setdefault(kind, SAFETENSORS_DTYPES[view.get_dtype()])
                    names.setdefault(target[0], []).extend({raw, name})  # as read, as split (Mixtral)
    return stored, names, fused


def swap_in_packed(model: CausalLM, quant_spec: QuantSpec, files: list[Path]) -> dict[str, PackedLinear]:
    """Replace (on meta) each decoder projection the checkpoint stores quantized (its tensors include the format's
    marker) with the format's PackedLinear, and quantized experts with PackedExperts; returns {checkpoint tensor
    name: the dense module it loads into}."""
    packed_cls = format_for(quant_spec)
    stored, names, fused = _stored_kinds(model, files)
    comm, packed, experts = model.comm, {}, {}
    experts_cls = getattr(packed_cls, "experts_cls", None)  # a format's own stacked experts (fp8)
    if experts_cls is not None:  # kinds the plain experts route to each expert (compressed-tensors' weight_scale):
        for module_name in [name for name in stored if _EXPERT.match(name)]:  # the stacked experts' too
            layer = stored.setdefault(_EXPERT.match(module_name).group(1), {})
            for kind, dtype in stored.pop(module_name).items():
                layer.setdefault(kind, dtype)
    for module_name, kinds in stored.items():
        if packed_cls.marker not in kinds:
            if any(dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for dtype in kinds.values()):
                raise ValueError(f"{quant_spec.describe()}: {module_name!r} has fp8 tensors without their "
                                 f"{packed_cls.marker!r}: the checkpoint is missing its scales")
            continue
        if experts_cls is not None and isinstance(model.get_submodule(module_name), Experts):
            parent, _, attr = module_name.rpartition(".")  # its weights sharded as Experts' are, its scales whole
            module = AS_EXPERTS[experts_cls](model.get_submodule(module_name), quant_spec, name=module_name,
                                             tp_rank=comm.rank, tp_size=comm.size)
            setattr(model.get_submodule(parent), attr, module)
            continue
        expert = _EXPERT.match(module_name)
        if expert is not None:  # experts.{gate_up_proj,down_proj}.{e}: one PackedExperts per layer, below
            experts.setdefault(expert.group(1), {}).setdefault(expert.group(2), kinds)
            continue
        try:
            base = model.get_submodule(module_name)
        except AttributeError:
            base = None
        if not isinstance(base, Linear) or module_name.rpartition(".")[2] not in PACKED_MODULES:
            raise ValueError(f"{quant_spec.describe()}: quantized tensors for {module_name!r}, which this engine "
                             f"serves only in full precision")
        module = packed_cls(base, quant_spec, name=module_name, dtypes=kinds, tp_size=comm.size, tp_rank=comm.rank,
                            row_parallel=module_name.rpartition(".")[2] in ROW_PARALLEL)
        module.stored_fused = fused.get(module_name, set())
        parent, _, attr = module_name.rpartition(".")
        setattr(model.get_submodule(parent), attr, module)
        packed.update({name: module for name in names[module_name]})
    for experts_name, dtypes in experts.items():
        base = model.get_submodule(experts_name)
        if not isinstance(base, Experts) or set(dtypes) != {"gate_up_proj", "down_proj"}:
            raise ValueError(f"{experts_name}: quantized tensors for only some of the experts' projections")
        module = PackedMoEExperts(base, packed_cls, quant_spec, name=experts_name, dtypes=dtypes, linear=Linear,
                                  tp_size=comm.size)
        parent, _, attr = experts_name.rpartition(".")
        setattr(model.get_submodule(parent), attr, module)
        for projection in ("gate_up_proj", "down_proj"):  # each expert's tensors: read as its own projection's
            for e, expert in enumerate(getattr(module, projection)):
                packed.update({name: expert for name in names.get(f"{experts_name}.{projection}.{e}", [])})
    if not packed and not experts and not any(isinstance(m, Experts) and getattr(m, "loads_as_stored", False)
                                              for m in model.modules()):
        raise ValueError(f"config.json says {quant_spec.describe()} but no projection in the checkpoint has its "
                         f"{packed_cls.marker!r} tensors")
    return packed


def finish_packed(model: CausalLM, release=lambda: None) -> None:
    """Every tensor is loaded: each packed projection into its kernel layout, then the experts stacked. release()
    comes before each of those steps (on CUDA the loader empties torch's cache there: loader.release_cache)."""
    modules = list(model.modules())
    for module in modules:
        if isinstance(module, PackedLinear) or (isinstance(module, Experts) and getattr(module, "loads_as_stored", False)):
            release()
            module.finish()
    for module in modules:
        if isinstance(module, PackedExperts):
            release()
            module.stack()
