"""Loading a model (or one rank's shard of it) from a Hugging Face checkpoint directory.

The model is built on the meta device and its tensors are given memory as the checkpoint is read: the
embeddings, norms and lm_head up front, each decoder projection when its first tensor comes. With a
quantization, a projection is quantized as soon as its last tensor is loaded, so the full-precision
weights alive at once are only those of the projections being read: the peak is the quantized model
plus about one projection, not the unquantized model (docs/quantization.md). A checkpoint quantized before it
was downloaded (config.json's `quantization_config`: GPTQ, AWQ, compressed-tensors, fp8) has its projections
swapped for its format's PackedLinear before any tensor is read, and each is loaded as stored
(engine/quantization/)."""

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.lora_modules import PACKED_MODULES
from engine.models.causal_lm import CausalLM
from engine.models.linear import Linear
from engine.models.prequantized import finish_packed, swap_in_packed
from engine.models.registry import model_class
from engine.parallel import sharding
from engine.parallel.communicator import Communicator
from engine.quantization import checkpoint_quantization, shard_index
from engine.quantization.on_load import check_quantization, quantize_projection


def decoder_projections(model: nn.Module) -> list[str]:
    """Names of the decoder projections that quantization replaces (PACKED_MODULES of every layer)."""
    return [name for name, module in model.named_modules()
            if isinstance(module, Linear) and name.rpartition(".")[2] in PACKED_MODULES and ".layers." in name]


def quantize_model(model: nn.Module, method: str) -> None:
    """Replace each decoder projection of a loaded model with its QuantizedLinear, one at a time (load_model
    does the same as it reads the checkpoint)."""
    device = next(model.parameters()).device
    check_quantization(method, device)
    for name in decoder_projections(model):
        quantize_projection(model, name, method)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the pool is sized from free memory next


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


def _iter_weights(files: list[Path], *, rank: int = 0, size: int = 1, parts=lambda name, shape: None,
                  packed_slice=lambda name, shape: NotImplemented):
    """(name, tensor) of every checkpoint tensor; with size > 1 only rank's part of it is read. A tensor that
    `parts` splits (a fused checkpoint's qkv_proj: CausalLM.checkpoint_parts) comes as its split tensors, each
    sharded as that projection is: a part (name, first row, end row) of a 2-D tensor, (name, expert, first row,
    end row) of stacked experts [E, rows, columns]. `packed_slice` gives the part of a pre-quantized projection's
    stored tensor (NotImplemented for any other tensor)."""
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                view = f.get_slice(name)
                shape = tuple(view.get_shape())
                split = parts(name, shape)
                if split is not None:
                    for part, *where in split:
                        expert = (slice(where[0], where[0] + 1),) if len(where) == 3 else ()  # stacked experts
                        start, end = where[-2:]
                        part_shape = (end - start, *shape[1 + len(expert):])
                        index = packed_slice(part, part_shape)
                        if index is NotImplemented:
                            index = sharding.checkpoint_slice(part, part_shape, rank=rank, size=size)
                        index = index or (slice(None),)
                        rows = range(start, end)[index[0]]  # this rank's rows of the part, in the fused tensor
                        tensor = view[(*expert, slice(rows.start, rows.stop), *index[1:])]
                        yield part, tensor[0] if expert else tensor
                    continue
                if sharding.holds_none(name, rank=rank, size=size):
                    yield name, torch.zeros(shape)
                    continue
                index = packed_slice(name, shape)
                if index is NotImplemented:
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


def _pieces(module: Linear) -> set[tuple[str, int]]:
    """The (kind, slice) tensors a projection is loaded from."""
    kinds = ("weight", "bias") if module.bias is not None else ("weight",)
    return {(kind, i) for kind in kinds for i in range(len(module.out_slices))}


def _as_loaded(model: CausalLM, weights, *, device: torch.device, quantization: str | None):
    """The checkpoint's tensors, passed on to load_weights (which copies each before asking for the next):
    a projection gets its memory with its first tensor and is quantized right after its last."""
    missing = {name: _pieces(model.get_submodule(name)) for name in decoder_projections(model)}
    for name, tensor in weights:
        target = model.checkpoint_target(name)
        pieces = missing.get(target[0]) if target is not None else None
        if pieces is not None and model.get_submodule(target[0]).weight.is_meta:
            model.get_submodule(target[0]).to_empty(device=device)
        yield name, tensor
        if pieces is not None:
            pieces.discard((target[1], target[2] or 0))
            if not pieces:
                del missing[target[0]]
                if quantization is not None:
                    quantize_projection(model, target[0], quantization)


def load_model(model_dir: str | Path, *, dtype: torch.dtype, device: torch.device,
               comm: Communicator | None = None, quantization: str | None = None) -> CausalLM:
    """The model, or with `comm` of size N only rank comm.rank's shard of it (read as such from the files),
    its decoder projections quantized ("int8", "fp8") as they are read when `quantization` is given."""
    model_dir = Path(model_dir)
    config = read_hf_config(model_dir)
    cls = model_class(config)
    spec = cls.read_spec(config)
    comm = comm or Communicator()
    if comm.size > 1:
        sharding.check_divisible(num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                                 intermediate_size=spec.intermediate_size, size=comm.size)
    quant_spec = checkpoint_quantization(config, quantization=quantization)
    if quantization is not None:
        check_quantization(quantization, device)
    files = _safetensors_files(model_dir)
    with _default_dtype(dtype), torch.device("meta"):
        model = cls(spec, comm)
    packed_names = swap_in_packed(model, quant_spec, files) if quant_spec is not None else {}
    projections = set(decoder_projections(model))
    for name, module in model.named_modules():
        if name not in projections and not (name == "lm_head" and spec.tie_word_embeddings):
            module.to_empty(device=device, recurse=False)
    model.tie_weights()
    with _default_dtype(dtype), device:
        model.build_rope_cache()
    def packed_slice(name: str, shape: tuple[int, ...]):
        module = packed_names.get(name)
        if module is None:
            return NotImplemented
        if stored_fused(name):  # read whole: load_fused takes each slice's share
            return None
        kind = name.rpartition(".")[2]
        layout = module.layouts(quant_spec).get(kind)
        if layout is None:  # a bias: as a Linear's
            return sharding.checkpoint_slice(name, shape, rank=comm.rank, size=comm.size)
        return shard_index(layout, shape, rank=comm.rank, size=comm.size, column=not module.row_parallel)

    def stored_fused(name: str) -> bool:
        """A fused projection served packed and stored fused (Phi-3's qkv_proj.qweight, and its fp8 weight)."""
        module = packed_names.get(name)
        return module is not None and name in module.stored_fused

    def parts(name: str, shape: tuple[int, ...]):
        return None if stored_fused(name) else model.checkpoint_parts(name, shape)

    weights = _iter_weights(files, rank=comm.rank, size=comm.size, parts=parts, packed_slice=packed_slice)
    model.load_weights(_as_loaded(model, weights, device=device, quantization=quantization))
    finish_packed(model, release=lambda: release_cache(device))
    model.quant_spec = quant_spec
    if quantization is not None or quant_spec is not None:
        release_cache(device)
    return model.eval()


def release_cache(device: torch.device) -> None:
    """Hand what torch's CUDA cache holds unused back to the device. The page pool is sized from free memory once
    the weights are in, so what quantizing, or turning stored tensors into their kernel layout (AWQ and
    compressed-tensors repacked, act order sorted), left there would shrink it. The loader also calls it before
    each packed projection is finished, so that the kernel tensors that one makes first are not cut from the
    blocks the previous one's scratch left cached: a kept tensor keeps its whole segment from going back."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
