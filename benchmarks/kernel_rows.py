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


def graph_us(launch, copies: int, device: str, replays: int = 5) -> float:
    """µs per call of launch(copy), the calls cycling over the copies: on CUDA the median of `replays` replays of a
    CUDA graph of max(16, copies) calls (launch(0) must have run once: Triton compiles outside the capture)."""
    if device != "cuda":
        return bench_ms(lambda: launch(0)) * 1e3
    launches = max(16, copies)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch(1 % copies)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            launch(i % copies)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    del graph
    return sorted(times)[len(times) // 2]


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
