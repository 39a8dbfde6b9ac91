"""Compile every Triton kernel for a GPU target (PTX and cubin via Triton's bundled ptxas), with no GPU.

The interpreter runs kernels as Python and accepts constructs the compiler rejects, so the
launchers are called with a recorder in place of each kernel and the recorded launches are then
compiled with their real argument types and constexprs. Run as a script in a process where
Triton is NOT in interpreter mode: `python tests/kernels/compile_check.py [arch] [workers]` prints
{case: "ok" | error} as JSON.
"""

import importlib
import json
import math
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels import LoRAMeta  # noqa: E402

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32", torch.int64: "i64",
         torch.float8_e4m3fn: "fp8e4nv"}


class _Recorder:
    def __init__(self, fn):
        self.fn, self.launches = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def _recorded_launches(op: str, *args, **kwargs) -> list[tuple]:
    module = importlib.import_module(f"kernels.{op}")
    modules = (module, importlib.import_module("kernels.split_k"))  # a split-K launch's sum runs after it
    kernels = {(m, name): value for m in modules for name, value in vars(m).items() if name.startswith("_")
               and hasattr(value, "fn") and name.endswith("_kernel")}  # fmt: skip
    recorders = {key: _Recorder(value.fn) for key, value in kernels.items()}
    try:
        for (m, name), recorder in recorders.items():
            setattr(m, name, recorder)
        getattr(module, op)(*args, **kwargs)
    finally:
        for (m, name), value in kernels.items():
            setattr(m, name, value)
    return [(r.fn, a, k) for r in recorders.values() for a, k in r.launches]


def _type_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if abs(value) < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unexpected kernel argument {value!r}")


def _compile(fn, args, kwargs, arch: int):
    """Compile as the JIT specializes a launch: an int argument equal to 1 becomes a constant, and tensors whose
    address and ints that are multiples of 16 carry tt.divisibility 16 (what lets Triton prove loads aligned),
    except for the kernel's do_not_specialize arguments."""
    kernel = JITFunction(fn)
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
    signature, attrs, constants = {}, {}, dict(kwargs)
    for index, (param, value) in enumerate(zip(kernel.params, args, strict=False)):
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if not param.do_not_specialize and is_int and value == 1:
            constants[param.name] = 1
            continue
        signature[param.name] = _type_of(value)
        aligned = value.data_ptr() % 16 == 0 if isinstance(value, torch.Tensor) else is_int and value % 16 == 0
        if aligned and not param.do_not_specialize and not param.do_not_specialize_on_alignment:
            attrs[(index,)] = [["tt.divisibility", 16]]
    signature.update({name: "constexpr" for name in constants})
    signature = {param.name: signature[param.name] for param in kernel.params}
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", arch, 32),
                          options=options)


def _lora_inputs(tokens, dtype):
    x = torch.randn(tokens, 4096).to(dtype)
    pages = torch.randn(1 << 20).to(dtype)
    a_rows = torch.randint(0, (1 << 20) - 4096, (3, 4, 16), dtype=torch.int64)
    slots = torch.randint(-1, 4, (tokens,), dtype=torch.int32)
    return x, pages, a_rows, slots, torch.tensor([[16, 8, 4, 1]] * 3, dtype=torch.int32)


def _paged(dtype, batch=2, blocks=64):
    cache = torch.randn(blocks * batch, 16, 8, 128).to(dtype)
    tables = torch.arange(blocks * batch, dtype=torch.int32).view(batch, blocks)
    return cache, tables, torch.tensor([1000, 7], dtype=torch.int32)


def _fp8_launches(case: str, dtype: torch.dtype) -> list[tuple]:
    """The fp8 KV cache (docs/quantization.md): caches in float8_e4m3fn with float32 scales per token and head."""
    cache, tables, lens = _paged(dtype)
    cache = cache.to(torch.float8_e4m3fn)
    scales = torch.rand(cache.shape[:3])
    if case == "store_kv":
        k = torch.randn(5, 8, 128).to(dtype)
        return _recorded_launches("store_kv", k, k, cache, cache, torch.arange(5), scales, scales)
    extra = _WINDOW_SOFTCAP if case.endswith("-window-softcap") else {}
    case = case.removesuffix("-window-softcap")
    if case.startswith("paged_attention_decode"):
        q = torch.randn(2, 32, 128).to(dtype)
        partition = 512 if case.endswith("split-kv") else 0
        return _recorded_launches("paged_attention_decode", q, cache, cache, tables, lens, 0.1, scales, scales,
                                  partition_size=partition, **extra)  # fmt: skip
    q = torch.randn(20, 32, 128).to(dtype)
    cu = torch.tensor([0, 13, 20], dtype=torch.int32)
    return _recorded_launches("paged_attention_prefill", q, cache, cache, cu, tables, lens, 0.1, scales, scales,
                              **extra)


_WINDOW_SOFTCAP = {"window": 100, "softcap": 50.0}


def _launches(case: str, dtype: torch.dtype) -> list[tuple]:
    if "-fp8kv" in case:
        return _fp8_launches(case.replace("-fp8kv", ""), dtype)
    if case == "lora_shrink-split-k":
        return _recorded_launches("lora_shrink", *_lora_inputs(1, dtype))
    if case == "lora_shrink":
        return _recorded_launches("lora_shrink", *_lora_inputs(256, dtype))
    if case == "lora_expand":
        x, pages, b_rows, slots, ranks = _lora_inputs(64, dtype)
        buf = torch.randn(3, 64, 16).to(dtype)
        meta = LoRAMeta.build(slots, 4)
        return _recorded_launches("lora_expand", torch.randn(64, 6144).to(dtype), buf, pages, b_rows, slots, ranks,
                                  torch.ones(3, 4), (0, 4096, 5120, 6144), meta=meta)  # fmt: skip
    if case in ("lora_delta", "lora_delta-aligned-rows"):  # one launch for q/k/v, A and B: views of one static table
        x, pages, rows, slots, ranks = _lora_inputs(64, dtype)
        table = torch.stack([rows, rows], dim=1)  # [S, 2, U, R]
        return _recorded_launches("lora_delta", torch.randn(64, 6144).to(dtype), x, pages, table[:, 0], table[:, 1],
                                  slots, ranks, torch.ones(3, 4), (0, 4096, 5120, 6144), meta=LoRAMeta.build(slots, 4),
                                  row_align=8 if case.endswith("aligned-rows") else 1)  # aligned: the engine's pages
    cache, tables, lens = _paged(dtype)
    extra = _WINDOW_SOFTCAP if case.endswith("-window-softcap") else {}
    case = case.removesuffix("-window-softcap")
    if case == "paged_attention_decode-split-kv":
        q = torch.randn(2, 32, 128).to(dtype)
        return _recorded_launches("paged_attention_decode", q, cache, cache, tables, lens, 0.1, partition_size=512,
                                  **extra)  # fmt: skip
    if case == "paged_attention_decode":
        q = torch.randn(2, 32, 128).to(dtype)
        return _recorded_launches("paged_attention_decode", q, cache, cache, tables, lens, 0.1, partition_size=0,
                                  **extra)  # fmt: skip
    if case == "paged_attention_prefill":
        q = torch.randn(20, 32, 128).to(dtype)
        cu = torch.tensor([0, 13, 20], dtype=torch.int32)
        return _recorded_launches("paged_attention_prefill", q, cache, cache, cu, tables, lens, 1 / math.sqrt(128),
                                  **extra)  # fmt: skip
    if case == "store_kv":
        k = torch.randn(5, 8, 128).to(dtype)
        return _recorded_launches("store_kv", k, k, cache, cache, torch.arange(5))
    if case == "rms_norm":
        x = torch.randn(3, 4096).to(dtype)
        return _recorded_launches("rms_norm", x, torch.ones(4096).to(dtype), 1e-5, x.clone())
    if case == "rotary_embedding":
        qkv = torch.randn(3, 48, 128).to(dtype)
        return _recorded_launches("rotary_embedding", torch.arange(3), qkv[:, :32], qkv[:, 32:40], torch.randn(64, 128))
    if case == "rotary_embedding-partial":  # Phi-4-mini: 96 of 128 dims rotated
        qkv = torch.randn(3, 40, 128).to(dtype)
        return _recorded_launches("rotary_embedding", torch.arange(3), qkv[:, :24], qkv[:, 24:32], torch.randn(64, 96))
    if case == "silu_and_mul":
        return _recorded_launches("silu_and_mul", torch.randn(3, 2 * 14336).to(dtype))
    if case == "fp8_block_linear":  # an fp8 checkpoint's gate_up at Llama-3-8B's shape, a decode batch of 64
        weight = torch.randn(2 * 14336, 4096).to(torch.float8_e4m3fn)
        return _recorded_launches("fp8_block_linear", torch.randn(64, 4096).to(dtype), weight,
                                  torch.rand(2 * 14336, 32), 128)
    if case == "grouped_matmul-fp8":  # fp8 experts (Qwen3-30B-A3B-FP8's shape) with their block scales
        weight = torch.randn(8, 1536, 2048).to(torch.float8_e4m3fn)
        offsets = torch.tensor([0, 3, 3, 10, 12, 20, 20, 25, 32], dtype=torch.int32)
        return _recorded_launches("grouped_matmul", torch.randn(32, 2048).to(dtype), weight, offsets,
                                  torch.rand(8, 1536, 16), 128)
    if case == "gelu_tanh_and_mul":
        return _recorded_launches("gelu_tanh_and_mul", torch.randn(3, 2 * 9216).to(dtype))
    if case.startswith("wna16"):
        return _wna16_launches(case, dtype)
    raise AssertionError(case)


def _wna16_launches(case: str, dtype: torch.dtype) -> list[tuple]:
    """Pre-quantized checkpoints' GEMMs (docs/quantization.md): 4- or 8-bit weights of Llama-3-8B's gate/up."""
    bits = 8 if "-w8" in case else 4
    per, k, n, groups = 32 // bits, 4096, 1024, 32
    weights = (torch.zeros(k // per, n, dtype=torch.int32), torch.rand(groups, n).half(),
               torch.zeros(groups, n // per, dtype=torch.int32), (torch.arange(k) // 128).int())
    if case.startswith("wna16_grouped_matmul"):
        experts = 4
        stacked = [torch.stack([w] * experts) for w in weights]
        offsets = torch.tensor([0, 3, 3, 9, 12], dtype=torch.int32)
        perm = torch.stack([torch.randperm(k).int()] * experts) if case.endswith("-perm") else None
        return _recorded_launches("wna16_grouped_matmul", torch.randn(12, k).to(dtype), *stacked, offsets, bits,
                                  group_size=128 if "-in-order" in case else 0, perm=perm)
    group_size = 128 if "-in-order" in case else 0
    perm = torch.randperm(k).int() if case.endswith("-perm") else None  # act order, sorted at load
    return _recorded_launches("wna16_linear", torch.randn(16, k).to(dtype), *weights, bits, group_size=group_size,
                              perm=perm)


CASES = [
    "lora_delta", "lora_delta-aligned-rows", "lora_shrink", "lora_shrink-split-k", "lora_expand", "paged_attention_decode",
    "paged_attention_decode-split-kv",
    "paged_attention_prefill", "store_kv", "rms_norm", "rotary_embedding", "silu_and_mul",
    "store_kv-fp8kv", "paged_attention_decode-fp8kv", "paged_attention_decode-split-kv-fp8kv",
    "paged_attention_prefill-fp8kv", "gelu_tanh_and_mul", "rotary_embedding-partial",
    "paged_attention_decode-window-softcap", "paged_attention_decode-split-kv-window-softcap",
    "paged_attention_prefill-window-softcap", "paged_attention_decode-split-kv-fp8kv-window-softcap",
    "paged_attention_prefill-fp8kv-window-softcap", "wna16_linear", "wna16_linear-w8", "wna16_grouped_matmul",
    "wna16_linear-in-order", "wna16_grouped_matmul-in-order", "wna16_linear-in-order-perm",
    "wna16_grouped_matmul-in-order-perm", "fp8_block_linear", "grouped_matmul-fp8",
]  # fmt: skip
DOT_CASES = ["lora_delta", "lora_shrink", "lora_expand", "paged_attention_decode", "paged_attention_prefill",
             "paged_attention_prefill-window-softcap", "wna16_linear", "fp8_block_linear"]




def _check(case: str, dtype_name: str, arch: int) -> tuple[str, str]:
    dtype = getattr(torch, dtype_name)
    name = f"{case}-{TYPES[dtype]}"
    try:
        launches = _launches(case, dtype)
        if not launches:
            raise AssertionError("the launcher launched nothing")
        for fn, args, kwargs in launches:
            compiled = _compile(fn, args, dict(kwargs), arch=arch)
            if ".entry" not in compiled.asm["ptx"] or not compiled.asm["cubin"]:
                raise AssertionError("no PTX entry or cubin produced")
        return name, "ok"
    except Exception as exc:  # reported per case to the test
        return name, f"{type(exc).__name__}: {exc}"


def main(arch: int, workers: int) -> dict[str, str]:
    """Each case compiles in one of `workers` fresh processes (Triton's compiler is single-threaded: on a 2-core
    machine whose tests run one at a time, the second core would sit idle)."""
    jobs = [(c, "bfloat16") for c in CASES] + [(c, "float32") for c in DOT_CASES]
    if workers <= 1:
        return dict(_check(case, dtype, arch) for case, dtype in jobs)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_check, case, dtype, arch) for case, dtype in jobs]
        return dict(future.result() for future in futures)


if __name__ == "__main__":
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    print(json.dumps(main(arch, workers=int(sys.argv[2]) if len(sys.argv) > 2 else min(2, os.cpu_count() or 1))))
