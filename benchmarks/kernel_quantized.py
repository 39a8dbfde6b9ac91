"""benchmarks/kernels.py --only wna16 fp8_block: the quantized checkpoints' GEMMs at Llama-3-8B's decode shapes
against torch's bf16 matmul of the same shape, so that one GPU call checks docs/quantization.md ("The W4A16 and
fp8 block kernels at decode").

wna16 (GPTQ W4A16, group 128, groups in order; T = 1, 64, 16 tokens through qkv, o, gate_up, down): the plan
(`kernels.wna16_linear.plan`), its split-K halved and doubled, and fixed tiles (one program per 64 columns,
BLOCK_K 64, no split; benchmarks/gpu-runs/2026-11-28-h200/w4a16.log has a kernel of these tiles end to end).
fp8_block (128x128 blocks; T = 64, 1, 16): the plan, its split-K halved and doubled, 64 columns a program, and an
occupancy rule (16 columns at T = 64, no split).
Each row's `bf16 µs` is F.linear with a bfloat16 weight of the same shape (cuBLAS); `vs bf16` is that over the
row's time, what the checkpoints' goals are about (W4A16 >= 2.5x at T <= 16, fp8 >= 1.6x at T = 64, end to end).

Timing: the median of 5 replays of one CUDA graph of `launches` launches, each on its own copy of the weights
(as many copies as twice the L2 needs, at most MAX_COPIES), so weights come from memory, as in a decode step that
streams every layer's weights between two launches of one. Rows are printed as they are measured; a SIGINT (the
suite's time limit) stops the sweep and keeps them. `ok`: the output equals kernels.reference's.
"""

import importlib
import math
import time

import torch
import torch.nn.functional as F

from benchmarks.kernel_lora_configs import projections
from benchmarks.kernel_rows import Row, graph_us
from kernels.launch import cdiv

# (op, tokens), in the order worth measuring first (the suite's part may stop early): W4A16 at batch 1 (its worst
# ratio, 0.71x), fp8 at 64 (its goal's batch), W4A16 at 64 and 16, fp8 at 1 and 16; each over the four projections
ORDER = [("wna16", 1), ("fp8_block", 64), ("wna16", 64), ("wna16", 16), ("fp8_block", 1), ("fp8_block", 16)]
PROJECTIONS = ("qkv", "o", "gate_up", "down")
SMOKE_SHAPES = [("wna16", 1, "o"), ("wna16", 5, "down"), ("fp8_block", 5, "o")]
GROUP, MAX_COPIES = 128, 16


def fixed_wna16_config(tokens: int):
    """Fixed tiles: 16 rows up to 16 tokens, 32 up to 64; 64 columns; K tiles of 64; no split."""
    from kernels.wna16_linear import WNA16Config

    return WNA16Config(16 if tokens <= 16 else 32 if tokens <= 64 else 64, 64, 64)


def occupancy_fp8_config(tokens: int, out_dim: int, sms: int) -> dict:
    """Columns halved from 128 (down to 16) until the row and column tiles reach 2 programs per SM; no split."""
    block_m = 16 if tokens <= 16 else 32 if tokens <= 32 else 64
    block_n = 128
    while block_n > 16 and cdiv(tokens, block_m) * cdiv(out_dim, block_n) < 2 * sms:
        block_n //= 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 4}


def quantized_rows(cfg, device, dtype, ops: set[str], *, smoke: bool) -> list[Row]:
    """Time each shape's candidates and torch's bf16 matmul; print each row as it comes."""
    from kernels.launch import multiprocessor_count

    sms = multiprocessor_count(torch.device(device))
    print(f"quantized GEMMs on {sms} SMs: µs per launch (graph replay, each launch on its own copy of the weights)")
    print("| op | shape | candidate | config | µs | GB/s | bf16 µs | vs bf16 | ok |")
    print("|---|---|---|---|---:|---:|---:|---:|---|", flush=True)
    rows, started = [], time.perf_counter()
    shapes = SMOKE_SHAPES if smoke else [(op, tokens, p) for op, tokens in ORDER for p in PROJECTIONS]
    shapes = [shape for shape in shapes if shape[0] in ops]
    try:
        for op, tokens, projection in shapes:
            in_dim, widths = projections(cfg)[projection]
            case = (_Wna16 if op == "wna16" else _Fp8Block)(tokens, in_dim, sum(widths), device, dtype, sms)
            bf16_us = _bf16_us(tokens, in_dim, sum(widths), device, dtype)
            measured = []
            for label, config in case.candidates():
                us, ok = case.time(config)
                gbs = case.min_bytes / (us * 1e-6) / 1e9
                measured.append((label, us))
                print(f"| {op} | {projection} T={tokens} | {label} | {_describe(config)} | {us:.1f} | {gbs:.0f} | "
                      f"{bf16_us:.1f} | {bf16_us / us:.2f}x | {'yes' if ok else 'NO'} |", flush=True)
                rows.append(Row(f"{op} config", f"{projection} T={tokens} | {label}: {_describe(config)}", us,
                                case.min_bytes, bf16_us, ok))
            best = min(measured, key=lambda m: m[1])
            print(f"best {op} {projection} T={tokens}: {best[0]} {best[1]:.1f} µs ({bf16_us / best[1]:.2f}x bf16); "
                  f"plan {measured[0][1]:.1f} µs ({bf16_us / measured[0][1]:.2f}x bf16) "
                  f"({time.perf_counter() - started:.0f} s so far)", flush=True)
            del case
    except KeyboardInterrupt:  # the suite's time limit: keep what was measured
        print(f"quantized GEMMs: stopped by the time limit after {len(rows)} rows", flush=True)
    return rows


def _describe(config) -> str:
    if isinstance(config, dict):
        return " ".join(f"{k.lower()}={v}" for k, v in config.items() if k != "num_warps")
    return str(config)


def _copies(device: str, weight_bytes: int) -> int:
    if device != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return min(MAX_COPIES, max(2, math.ceil(2 * l2 / weight_bytes)))


def _bf16_us(tokens, in_dim, out_dim, device, dtype) -> float:
    """torch's matmul of the shape with a weight in the activation dtype (cuBLAS on CUDA)."""
    weight = torch.randn(out_dim, in_dim, device=device, dtype=dtype) / in_dim**0.5
    copies = _copies(device, weight.numel() * weight.element_size())
    weights = [weight] + [weight.clone() for _ in range(copies - 1)]
    x = torch.randn(tokens, in_dim, device=device, dtype=dtype)
    F.linear(x, weights[0])
    return graph_us(lambda i: F.linear(x, weights[i]), copies, device)


class _Wna16:
    """A GPTQ W4A16 group-128 weight of the shape (random words), `copies` copies, x."""

    def __init__(self, tokens, in_dim, out_dim, device, dtype, sms):
        gen = torch.Generator(device=device).manual_seed(in_dim + out_dim)
        self.qweight = torch.randint(-(2**31), 2**31, (in_dim // 8, out_dim), generator=gen, device=device,
                                     dtype=torch.int32)  # fmt: skip
        self.scales = (torch.rand(in_dim // GROUP, out_dim, generator=gen, device=device) * 0.02 + 0.001).to(dtype)
        self.zeros = torch.randint(-(2**31), 2**31, (in_dim // GROUP, out_dim // 8), generator=gen, device=device,
                                   dtype=torch.int32)  # fmt: skip
        self.g_idx = (torch.arange(in_dim, device=device) // GROUP).to(torch.int32)
        self.min_bytes = (self.qweight.numel() * 4 + self.scales.numel() * self.scales.element_size()
                          + self.zeros.numel() * 4 + tokens * (in_dim + out_dim) * torch.finfo(dtype).bits // 8)
        self.copies = [self.qweight] + [self.qweight.clone() for _ in range(_copies(device, self.min_bytes) - 1)]
        self.x = torch.randn(tokens, in_dim, device=device, dtype=dtype)
        self.shape, self.device, self.sms = (tokens, in_dim, out_dim), device, sms
        self.op = importlib.import_module("kernels.wna16_linear")

    def candidates(self) -> list[tuple[str, object]]:
        import dataclasses

        tokens, in_dim, out_dim = self.shape
        planned = self.op.plan(tokens, out_dim, in_dim, GROUP, 4, self.sms)
        out = [("plan", planned), ("fixed tiles", fixed_wna16_config(tokens))]
        for label, split in (("split / 2", planned.split_k // 2), ("split x 2", planned.split_k * 2)):
            if 1 <= split <= cdiv(in_dim, planned.block_k):
                out.append((label, dataclasses.replace(planned, split_k=split)))
        return out

    def launch(self, copy: int, config) -> torch.Tensor:
        return self.op.wna16_linear(self.x, self.copies[copy], self.scales, self.zeros, self.g_idx, 4,
                                    group_size=GROUP, config=config)

    def time(self, config) -> tuple[float, bool]:
        from kernels import reference

        got = self.launch(0, config)  # compiles
        expected = reference.wna16_linear(self.x, self.qweight, self.scales, self.zeros, self.g_idx, 4)
        ok = bool(torch.allclose(got.float(), expected.float(), atol=3e-2, rtol=3e-2))
        return graph_us(lambda i: self.launch(i, config), len(self.copies), self.device), ok


class _Fp8Block:
    """An fp8 weight of the shape with float32 scales per row and 128 columns, `copies` copies, x."""

    def __init__(self, tokens, in_dim, out_dim, device, dtype, sms):
        weight = (torch.randn(out_dim, in_dim, device=device) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        self.scales = torch.rand(out_dim, cdiv(in_dim, GROUP), device=device) * 1e-3 + 1e-4
        self.min_bytes = (weight.numel() + self.scales.numel() * 4
                          + tokens * (in_dim + out_dim) * torch.finfo(dtype).bits // 8)
        self.copies = [weight] + [weight.clone() for _ in range(_copies(device, self.min_bytes) - 1)]
        self.x = torch.randn(tokens, in_dim, device=device, dtype=dtype)
        self.shape, self.device, self.sms = (tokens, in_dim, out_dim), device, sms
        self.op = importlib.import_module("kernels.fp8_block_linear")

    def candidates(self) -> list[tuple[str, dict]]:
        tokens, in_dim, out_dim = self.shape
        planned = self.op._config(tokens, out_dim, in_dim, GROUP, self.sms)
        out = [("plan", planned), ("occupancy rule", occupancy_fp8_config(tokens, out_dim, self.sms))]
        for label, split in (("split / 2", planned["SPLIT_K"] // 2), ("split x 2", planned["SPLIT_K"] * 2)):
            if 1 <= split <= cdiv(in_dim, planned["BLOCK_K"]):
                out.append((label, {**planned, "SPLIT_K": split}))
        if planned["BLOCK_N"] != 64:
            out.append(("64 columns", {**planned, "BLOCK_N": 64}))
        return out

    def launch(self, copy: int, config) -> torch.Tensor:
        return self.op.fp8_block_linear(self.x, self.copies[copy], self.scales, GROUP, config=config)

    def time(self, config) -> tuple[float, bool]:
        from kernels import reference

        got = self.launch(0, config)
        expected = reference.fp8_block_linear(self.x, self.copies[0], self.scales, GROUP)
        ok = bool(torch.allclose(got.float(), expected.float(), atol=3e-2, rtol=3e-2))
        return graph_us(lambda i: self.launch(i, config), len(self.copies), self.device), ok
