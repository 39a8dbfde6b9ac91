"""A validated adapter in Quilt's canonical form: its tensors, ranks, scalings and content digest.

`save(dir)` writes a folder that is at once a PEFT adapter (PEFT and `load_adapter` read it back,
every module's rank and alpha spelled out in rank_pattern/alpha_pattern) and Quilt's fast path
(`load_canonical` reads the sidecar, reads the tensors and checks them against the sidecar's checksums, and the
digest unless the caller already knows it).
"""

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from adapters import checksum
from adapters.base_shapes import ALL_MODULES, EXPERT_MODULES, ROUTER, peft_module_key
from adapters.errors import AdapterError
from adapters.file_reads import DEFAULT, ReadPolicy
from adapters.layout import CONFIG_NAME, WEIGHTS_NAME
from adapters.safetensors_check import read_tensors
from adapters.tensor_names import expert_tensor_name, experts_by_layer, parse_tensor_name

FORMAT = "quilt-lora/1"
SIDECAR_NAME = "quilt_adapter.json"
CHECKSUMS = "checksums"  # the sidecar key that holds them (adapters.checksum); not a field of LoadedAdapter
_DTYPE_NAMES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}


@dataclass(frozen=True, eq=False)
class LoadedAdapter:
    digest: str
    rank: int
    ranks: dict[str, int]  # "layers.{i}.{module}" -> r
    alpha: float
    scaling: dict[str, float]  # "layers.{i}.{module}" -> alpha/r or alpha/sqrt(r)
    target_modules: list[str]
    num_bytes: int
    tensors: dict[str, torch.Tensor]  # "layers.{i}.{module}.lora_A" [r, in], ".lora_B" [out, r]; the experts'
    # modules as PEFT stacks them: lora_A [E*r, in] (expert e's rows e*r ..), lora_B [out, r*E] (column j*E + e)
    config: dict[str, Any]  # normalized settings: use_rslora, per-module alphas, base model hints

    @classmethod
    def build(
        cls,
        *,
        tensors: dict[str, torch.Tensor],
        ranks: dict[str, int],
        alphas: dict[str, float],
        scaling: dict[str, float],
        alpha: float,
        use_rslora: bool,
        base_model_name_or_path: str | None,
    ) -> "LoadedAdapter":
        modules = {name.rsplit(".", 1)[-1] for name in ranks}
        return cls(
            digest=adapter_digest(tensors, scaling),
            rank=max(ranks.values()),
            ranks=dict(sorted(ranks.items())),
            alpha=alpha,
            scaling=dict(sorted(scaling.items())),
            target_modules=[m for m in ALL_MODULES if m in modules],
            num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
            tensors=dict(sorted(tensors.items())),
            config={
                "format": FORMAT,
                "r": max(ranks.values()),
                "lora_alpha": alpha,
                "use_rslora": use_rslora,
                "alphas": dict(sorted(alphas.items())),
                "base_model_name_or_path": base_model_name_or_path,
            },
        )

    def save(self, directory: str | Path) -> Path:
        """Write the canonical folder (PEFT-readable adapter + Quilt sidecar); returns its path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        experts = experts_by_layer(self.ranks)
        peft_tensors = {_peft_name(name, experts): tensor.contiguous() for name, tensor in self.tensors.items()}
        weights = safetensors.torch.save(peft_tensors, metadata={"format": "pt"})
        (directory / WEIGHTS_NAME).write_bytes(weights)
        (directory / CONFIG_NAME).write_text(json.dumps(self._peft_config(), indent=2, sort_keys=True))
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "tensors"}
        checksums = {"algorithm": checksum.ALGORITHM, "files": {WEIGHTS_NAME: checksum.of_bytes(weights)},
                     "fields": checksum.of_fields(fields)}
        (directory / SIDECAR_NAME).write_text(json.dumps({**fields, CHECKSUMS: checksums}, indent=2, sort_keys=True))
        return directory

    def _peft_config(self) -> dict[str, Any]:
        keys = {name: peft_module_key(*_layer_module(name)) for name in self.ranks}
        experts = {name for name in self.ranks if _layer_module(name)[1] in (*EXPERT_MODULES, ROUTER)}
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self.config.get("base_model_name_or_path"),
            "r": self.rank,
            "lora_alpha": self.alpha,
            "use_rslora": self.config["use_rslora"],
            "target_modules": sorted(key for name, key in keys.items() if name not in experts),
            "target_parameters": sorted(keys[name] for name in experts) or None,
            "rank_pattern": {re.escape(keys[name]): rank for name, rank in self.ranks.items()},
            "alpha_pattern": {re.escape(keys[name]): alpha for name, alpha in self.config["alphas"].items()},
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
        }


def load_canonical(directory: str | Path, *, digest: str | None = None, policy: ReadPolicy = DEFAULT) -> LoadedAdapter:
    """Read what `LoadedAdapter.save` wrote; AdapterError (canonical_corrupt) when any byte of it changed since.

    Every read checks the sidecar's checksums (adapters.checksum): the weights file's, over each block as it is
    read, and the sidecar's own fields'. Without `digest` the content digest is also recomputed and must match the
    sidecar's. With the digest the caller already knows (computed once, when the adapter was uploaded or first made
    known: the folder is content-addressed and immutable) the sidecar must name it and the tensors are not hashed
    again. A sidecar written before checksums were kept has only its digest to check the bytes by: it is
    recomputed on every read (slower, never unchecked; saving the adapter again adds the checksums). `policy`: how
    the weights file is read (adapters.file_reads: its pace, around the page cache or not)."""
    directory = Path(directory)
    try:
        sidecar = json.loads((directory / SIDECAR_NAME).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(
            "canonical_corrupt", f"{directory} holds no readable {SIDECAR_NAME} ({exc})"
        ) from None
    checksums = sidecar.pop(CHECKSUMS, None) if isinstance(sidecar, dict) else None
    fields = {field.name for field in dataclasses.fields(LoadedAdapter)} - {"tensors"}
    if (
        not isinstance(sidecar, dict)
        or set(sidecar) != fields
        or not isinstance(sidecar["config"], dict)
        or sidecar["config"].get("format") != FORMAT
        or not isinstance(sidecar["ranks"], dict)
    ):
        raise AdapterError("canonical_corrupt", f"{directory} is not a {FORMAT} canonical adapter")
    weights_checksum = _weights_checksum(directory, checksums, sidecar)
    if digest is not None and sidecar["digest"] != digest:
        raise AdapterError("digest_mismatch", f"its content has digest {str(sidecar['digest'])[:12]}")
    weights = directory / WEIGHTS_NAME
    experts = experts_by_layer(sidecar["ranks"])
    tensors = {
        parse_tensor_name(name, experts=experts).canonical: t
        for name, t in read_tensors(weights, checksum=weights_checksum, policy=policy).items()
    }
    expected = {f"{name}.{half}" for name in sidecar["ranks"] for half in ("lora_A", "lora_B")}
    if set(tensors) != expected or any(
        _rows(name, tensors[f"{name}.lora_A"].shape[0], rank) or tensors[f"{name}.lora_B"].shape[-1]
        != tensors[f"{name}.lora_A"].shape[0] for name, rank in sidecar["ranks"].items()
    ):
        raise AdapterError("canonical_corrupt", f"{directory}: tensors do not match {SIDECAR_NAME}")
    adapter = LoadedAdapter(**{**sidecar, "tensors": dict(sorted(tensors.items()))})
    if digest is not None and weights_checksum is not None:
        return adapter
    computed = adapter_digest(adapter.tensors, adapter.scaling)
    if computed != sidecar["digest"]:
        raise AdapterError(
            "canonical_corrupt", f"{directory}: content digest {computed} does not match {sidecar['digest']}"
        )
    return adapter


def _weights_checksum(directory: Path, checksums: Any, fields: dict[str, Any]) -> str | None:
    """The weights file's checksum from a sidecar whose own fields match theirs; None from a sidecar that keeps
    none (written before checksums were kept, or by a Quilt with another algorithm: its digest checks it)."""
    if not isinstance(checksums, dict) or checksums.get("algorithm") != checksum.ALGORITHM:
        return None
    files = checksums.get("files")
    if not isinstance(files, dict) or not isinstance(files.get(WEIGHTS_NAME), str):
        raise AdapterError("canonical_corrupt", f"{directory}: {SIDECAR_NAME} has malformed checksums")
    if checksums.get("fields") != checksum.of_fields(fields):
        raise AdapterError("canonical_corrupt", f"{directory}: {SIDECAR_NAME} changed after it was stored")
    return files[WEIGHTS_NAME]


def adapter_digest(tensors: dict[str, torch.Tensor], scaling: dict[str, float]) -> str:
    """sha256 over each tensor's (name, dtype, shape, bytes) in name order, then the per-module scalings."""
    digest = hashlib.sha256(FORMAT.encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        header = json.dumps([name, _DTYPE_NAMES[tensor.dtype], list(tensor.shape)]).encode()
        digest.update(len(header).to_bytes(8, "little") + header)
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    digest.update(json.dumps({"scaling": scaling}, sort_keys=True).encode())
    return digest.hexdigest()


def _layer_module(name: str) -> tuple[int, str]:
    _, layer, module = name.split(".")
    return int(layer), module


def _rows(name: str, rows: int, rank: int) -> bool:
    """Whether lora_A's row count is wrong for the module's rank (the experts': a multiple of it)."""
    return rows % rank != 0 if _layer_module(name)[1] in EXPERT_MODULES else rows != rank


def _peft_name(canonical: str, experts: dict[int, tuple[str, ...]]) -> str:
    _, layer, module, half = canonical.split(".")
    if module in EXPERT_MODULES:
        return expert_tensor_name(int(layer), module, half, experts[int(layer)])
    if module == ROUTER:
        return f"base_model.model.model.layers.{layer}.mlp.gate.{half}.weight"
    return f"base_model.model.{peft_module_key(int(layer), module)}.{half}.weight"
