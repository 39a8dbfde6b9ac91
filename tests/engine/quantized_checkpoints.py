"""Tiny pre-quantized checkpoints written to each format's published layout, and their dequantized twins.

`quantize_groups` rounds every decoder projection of a full-precision checkpoint to integers (RTN per group, act
order by a random g_idx when asked); the integer values, zeros and scales are then written in the format's own
layout (GPTQ v1/v2, AWQ gemm, compressed-tensors pack- and naive-quantized) next to a config.json naming it, and
W = (q - z) * s, computed here from the integers before any packing, goes into an fp32 checkpoint that transformers
loads as the oracle. The packing written here follows the formats' reference code (GPTQModel's pack, AutoAWQ's
gemm pack with its order, compressed-tensors' pack_to_int32) and is checked against fixtures of it in
tests/kernels/test_wna16_linear.py and tests/engine/test_quant_formats.py."""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.engine.conftest import build_tokenizer

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3",
               "qkv_proj", "gate_up_proj")  # the last two: Phi-3's fused ones
SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj", "w3": "w1"}  # the first reader
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class Quantized:
    q: torch.Tensor  # [out, in] unsigned ints in [0, 2**bits)
    zeros: torch.Tensor  # [G, out] unsigned
    scales: torch.Tensor  # [G, out] float16
    g_idx: torch.Tensor  # [in] int32

    def dequantized(self) -> torch.Tensor:  # [out, in] float32
        g = self.g_idx.long()
        return (self.q - self.zeros[g].t()).float() * self.scales.float()[g].t()


def quantize_groups(weight: torch.Tensor, *, bits: int, group_size: int, sym: bool, act_order: bool,
                    seed: int) -> Quantized:
    """Round-to-nearest per group of input channels (group_size -1: one group), each group's channels those with
    its g_idx (act order: a random dealing of the channels into groups)."""
    out, inp = weight.shape
    group = inp if group_size == -1 else group_size
    groups = inp // group
    if act_order:
        perm = torch.randperm(inp, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(inp, dtype=torch.int32)
        g_idx[perm] = (torch.arange(inp) // group).to(torch.int32)
    else:
        g_idx = (torch.arange(inp) // group).to(torch.int32)
    maxq = (1 << bits) - 1
    q = torch.empty(out, inp, dtype=torch.int32)
    zeros = torch.empty(groups, out, dtype=torch.int32)
    scales = torch.empty(groups, out, dtype=torch.float16)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        w = weight[:, cols].float()  # [out, group]
        if sym:
            scale = (w.abs().amax(1) / ((maxq + 1) / 2 - 0.5)).clamp(min=1e-5).half()
            zero = torch.full((out,), (maxq + 1) // 2, dtype=torch.int32)
        else:
            lo, hi = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
            scale = ((hi - lo) / maxq).clamp(min=1e-5).half()
            zero = torch.round(-lo / scale.float()).clamp(0, maxq).to(torch.int32)
        q[:, cols] = torch.round(w / scale.float()[:, None] + zero[:, None]).clamp(0, maxq).to(torch.int32)
        zeros[g], scales[g] = zero, scale
    return Quantized(q, zeros, scales, g_idx)


def pack(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack unsigned values along `dim`, 32 // bits per int32, the i-th lowest bits holding element
    order[i] of each run (in order when None)."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    if order is not None:
        v = v[..., list(order)]
    word = sum(v[..., i] << (bits * i) for i in range(per))
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.movedim(-1, dim).contiguous()


def gptq_tensors(qz: Quantized, *, bits: int, v1: bool) -> dict[str, torch.Tensor]:
    zeros = (qz.zeros - 1) & ((1 << bits) - 1) if v1 else qz.zeros
    return {"qweight": pack(qz.q.t(), bits, 0), "qzeros": pack(zeros, bits, 1), "scales": qz.scales,
            "g_idx": qz.g_idx}


def awq_tensors(qz: Quantized) -> dict[str, torch.Tensor]:
    return {"qweight": pack(qz.q.t(), 4, 1, AWQ_ORDER), "qzeros": pack(qz.zeros, 4, 1, AWQ_ORDER),
            "scales": qz.scales}


def pack_quantized_tensors(qz: Quantized, *, bits: int, sym: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized: signed values offset by 2**(bits - 1), i.e. the unsigned ones."""
    tensors = {"weight_packed": pack(qz.q, bits, 1), "weight_scale": qz.scales.t().contiguous(),
               "weight_shape": torch.tensor(list(qz.q.shape), dtype=torch.int64)}
    if not sym:
        tensors["weight_zero_point"] = pack(qz.zeros.t(), bits, 0)
    return tensors


def naive_quantized_tensors(qz: Quantized, *, sym: bool) -> dict[str, torch.Tensor]:
    tensors = {"weight": (qz.q - 128).to(torch.int8), "weight_scale": qz.scales.t().contiguous()}
    if not sym:
        tensors["weight_zero_point"] = (qz.zeros.t() - 128).to(torch.int8).contiguous()
    return tensors


def compressed_tensors_decompress(stored: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    """The fp32 weight [out, in] compressed-tensors' own compressor decompresses the stored tensors to (scales
    widened to float32 first, so its product is taken in float32 as the oracle's is)."""
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    group = config["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    compressor = PackedQuantizationCompressor if config["format"] == "pack-quantized" else NaiveQuantizationCompressor
    state = {**stored, "weight_scale": stored["weight_scale"].float()}
    return compressor.decompress(state, scheme)["weight"].float()


def quantization_config(fmt: str, *, bits: int, group_size: int, sym: bool, act_order: bool) -> dict:
    if fmt in ("gptq", "gptq_v2"):
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": sym,
                "checkpoint_format": fmt, "damp_percent": 0.01, "true_sequential": True}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    strategy = "channel" if group_size == -1 else "group"
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy,
               "group_size": None if group_size == -1 else group_size, "dynamic": False, "actorder": None,
               "observer": "minmax"}
    ct_format = {"pack": "pack-quantized", "naive": "naive-quantized"}[fmt]
    return {"quant_method": "compressed-tensors", "format": ct_format, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": ct_format}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def write_quantized(base_dir: Path, directory: Path, *, fmt: str, bits: int = 4, group_size: int = 32,
                    sym: bool = False, act_order: bool = False, seed: int = 0) -> tuple[Path, Path]:
    """(the checkpoint in format `fmt`: "gptq" (v1), "gptq_v2", "awq", "pack", "naive"; its dequantized fp32 twin)."""
    tensors = {}
    for shard in sorted(base_dir.glob("*.safetensors")):  # one file, or shards (written back as one)
        tensors.update(load_file(str(shard)))
    packed, dequantized = {}, dict(tensors)
    for name, weight in sorted(tensors.items()):
        prefix, _, kind = name.rpartition(".")
        if kind != "weight" or prefix.rpartition(".")[2] not in PROJECTIONS:
            packed[name] = weight
            continue
        # the projections reading one input share its act order (GPTQ orders by that input's Hessian)
        parent, _, proj = prefix.rpartition(".")
        shared_input = f"{parent}.{SHARED_INPUT.get(proj, proj)}"
        order_seed = seed + sum(map(ord, shared_input)) * 7919
        qz = quantize_groups(weight, bits=bits, group_size=group_size, sym=sym, act_order=act_order, seed=order_seed)
        dequantized[name] = qz.dequantized()
        if fmt in ("pack", "naive"):  # the oracle's weight as compressed-tensors itself decompresses it
            dequantized[name] = compressed_tensors_decompress(
                pack_quantized_tensors(qz, bits=bits, sym=sym) if fmt == "pack" else naive_quantized_tensors(qz, sym=sym),
                quantization_config(fmt, bits=bits, group_size=group_size, sym=sym, act_order=act_order))
            assert torch.equal(dequantized[name], qz.dequantized()), name
        if fmt in ("gptq", "gptq_v2"):
            stored = gptq_tensors(qz, bits=bits, v1=fmt == "gptq")
        elif fmt == "awq":
            stored = awq_tensors(qz)
        elif fmt == "pack":
            stored = pack_quantized_tensors(qz, bits=bits, sym=sym)
        else:
            stored = naive_quantized_tensors(qz, sym=sym)
        packed.update({f"{prefix}.{kind_}": t for kind_, t in stored.items()})
    config = json.loads((base_dir / "config.json").read_text())
    reference = directory.with_name(directory.name + "-dequantized")
    for out, state, extra in ((directory, packed, quantization_config(fmt, bits=bits, group_size=group_size, sym=sym,
                                                                       act_order=act_order)),
                              (reference, dequantized, None)):
        out.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps({**config, "quantization_config": extra} if extra else config))
        for extra_file in ("generation_config.json",):
            if (base_dir / extra_file).exists():
                shutil.copy(base_dir / extra_file, out / extra_file)
        build_tokenizer(out)
    return directory, reference
