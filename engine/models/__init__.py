"""Model architectures and loading from a Hugging Face checkpoint directory."""

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.llama import LlamaForCausalLM, ModelArgs
from engine.parallel import sharding
from engine.parallel.communicator import Communicator

__all__ = ["LlamaForCausalLM", "ModelArgs", "load_model", "read_hf_config"]


def read_hf_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def _iter_weights(files: list[Path], *, rank: int = 0, size: int = 1):
    """(name, tensor) of every checkpoint tensor; with size > 1 only rank's part of it is read."""
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                view = f.get_slice(name)
                shape = tuple(view.get_shape())
                if sharding.holds_none(name, rank=rank, size=size):
                    yield name, torch.zeros(shape)
                    continue
                index = sharding.checkpoint_slice(name, shape, rank=rank, size=size)
                yield name, f.get_tensor(name) if index is None else view[index]


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(model_dir: str | Path, *, dtype: torch.dtype, device: torch.device,
               comm: Communicator | None = None) -> LlamaForCausalLM:
    """The model, or with `comm` of size N only rank comm.rank's shard of it (read as such from the files)."""
    model_dir = Path(model_dir)
    args = ModelArgs.from_hf_config(read_hf_config(model_dir))
    comm = comm or Communicator()
    if comm.size > 1:
        sharding.check_divisible(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                                 intermediate_size=args.intermediate_size, size=comm.size)
    with _default_dtype(dtype), device:
        model = LlamaForCausalLM(args, comm)
    model.load_weights(_iter_weights(_safetensors_files(model_dir), rank=comm.rank, size=comm.size))
    return model.eval()
