"""Write adapters, archives and raw safetensors files in code, valid or deliberately broken."""

import io
import json
import struct
import tarfile
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from adapters import AdapterError, load_adapter

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def llama_config() -> LlamaConfig:
    return LlamaConfig(**TINY, head_dim=24)  # head_dim != hidden / heads: q is [96, 64], k/v [48, 64]


def mistral_config() -> MistralConfig:
    return MistralConfig(**TINY)


def qwen2_config() -> Qwen2Config:
    return Qwen2Config(**TINY)


def qwen3_config() -> Qwen3Config:
    return Qwen3Config(**TINY, head_dim=24)


def gemma2_config() -> Gemma2Config:
    return Gemma2Config(**TINY, head_dim=24)


def gemma3_text_config() -> Gemma3TextConfig:
    return Gemma3TextConfig(**TINY, head_dim=16)


def phi3_config() -> Phi3Config:
    """Phi-3 keeps q/k/v and gate/up fused: qkv_proj is [64 + 2 * 32, 64], gate_up_proj [2 * 96, 64]."""
    return Phi3Config(**TINY, pad_token_id=0)


def peft_lora_tensors(config: dict, *, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Tensors named as PEFT saves them for a config over the tiny Llama (q/v only, or config's targets)."""
    shapes = {"q_proj": (64, 96), "k_proj": (64, 48), "v_proj": (64, 48), "o_proj": (96, 64)}
    tensors = {}
    generator = torch.Generator().manual_seed(0)
    for layer in range(2):
        for module in config["target_modules"]:
            in_features, out_features = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            r = config["r"]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, in_features, generator=generator).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, r, generator=generator).to(dtype)
    return tensors


def lora_config(**overrides) -> dict:
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    config.update(overrides)
    return config


def write_adapter(
    directory: Path,
    *,
    config: dict | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
    raw_config: bytes | None = None,
    raw_weights: bytes | None = None,
    weights_name: str = "adapter_model.safetensors",
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """A PEFT-style adapter folder; by default a valid r=4 q/v LoRA over the tiny Llama."""
    directory.mkdir(parents=True, exist_ok=True)
    config = lora_config() if config is None else config
    tensors = peft_lora_tensors(config) if tensors is None else tensors
    (directory / "adapter_config.json").write_bytes(
        raw_config if raw_config is not None else json.dumps(config).encode()
    )
    if raw_weights is not None:
        (directory / weights_name).write_bytes(raw_weights)
    elif weights_name:
        safetensors.torch.save_file(tensors, directory / weights_name, metadata={"format": "pt"})
    for name, data in (extra_files or {}).items():
        (directory / name).write_bytes(data)
    return directory


def valid_files() -> dict[str, bytes]:
    """The two files of a valid adapter, as bytes, for building archives."""
    config = lora_config()
    return {
        "adapter_config.json": json.dumps(config).encode(),
        "adapter_model.safetensors": safetensors.torch.save(
            peft_lora_tensors(config), metadata={"format": "pt"}
        ),
    }


def raw_safetensors(header: dict, data: bytes, *, declared_header_size: int | None = None) -> bytes:
    encoded = json.dumps(header).encode()
    size = len(encoded) if declared_header_size is None else declared_header_size
    return struct.pack("<Q", size) + encoded + data


def valid_weights_bytes() -> bytes:
    return safetensors.torch.save(peft_lora_tensors(lora_config()))


def split_safetensors(data: bytes) -> tuple[dict, bytes]:
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def make_zip(path: Path, members: list[tuple[str | zipfile.ZipInfo, bytes]], *, deflate: bool = True) -> Path:
    compression = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", compression=compression) as archive, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Duplicate name")  # some cases repeat a name on purpose
        for name, data in members:
            if isinstance(name, zipfile.ZipInfo):
                name.compress_type = compression
            archive.writestr(name, data)
    return path


def make_tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]], *, gz: bool = True) -> Path:
    with tarfile.open(path, "w:gz" if gz else "w") as archive:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            archive.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def tar_file(name: str) -> tarfile.TarInfo:
    return tarfile.TarInfo(name)


def tar_special(name: str, kind: bytes, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info


def file_source(name: str, data: bytes) -> Callable[[Path], Path]:
    """A builder for a single uploaded file with the given name and bytes."""

    def build(tmp: Path) -> Path:
        (tmp / name).write_bytes(data)
        return tmp / name

    return build


def refusal(build, tmp_path, base_config) -> AdapterError:
    """The AdapterError that loading the source a case builds raises (the test fails if it loads)."""
    with pytest.raises(AdapterError) as refused:
        load_adapter(build(tmp_path), base_config)
    return refused.value


def distinct_refusal_messages(cases, tmp_path, base_config) -> set[str]:
    """Each case of a table `(id, build, code, fragment)` refused in a folder of its own; their messages."""
    messages = set()
    for index, (_, build, _, _) in enumerate(cases):
        case_dir = tmp_path / f"case{index}"
        case_dir.mkdir()
        messages.add(refusal(build, case_dir, base_config).message)
    return messages
