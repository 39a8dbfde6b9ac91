"""What every row of benchmarks/kernels.py shares: the row, the timer, the copy bandwidth rows are read against,
and the measurement of one op against its baseline."""

import time
from dataclasses import dataclass

import torch


@dataclass
class Row:
    op: str
    shape: str
    triton_us: float
    min_bytes: int
    baseline_us: float
    ok: bool
    flops: float = 0.0


def bench_ms(fn) -> float:
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    numel = (1 << 28) if device == "cuda" else (1 << 20)
    src = torch.empty(numel, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / (bench_ms(lambda: dst.copy_(src)) * 1e-3)


def measure(op, shape, fn, base, min_bytes, *, out=None, base_out=None, tol=3e-2, flops=0.0) -> Row:
    """Time fn and base; `out`/`base_out` return the outputs to compare (default: the call's result)."""
    got = (out or fn)()
    expect = (base_out or base)()
    ok = bool(torch.allclose(got.float(), expect.float(), atol=tol, rtol=tol))
    return Row(op, shape, bench_ms(fn) * 1e3, int(min_bytes), bench_ms(base) * 1e3, ok, flops)
