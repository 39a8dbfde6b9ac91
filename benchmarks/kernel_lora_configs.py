"""benchmarks/kernels.py --only lora_delta_configs: lora_delta's candidate configurations side by side at decode
shapes, so that a GPU session can choose by measurement in one call (docs/gpu.md, "lora_delta's launch").

For each shape (a Llama-3-8B projection, bf16, T decode tokens spread round-robin over the adapters), in order
of what a decode step at batch 64 spends: the configuration `kernels.lora_delta.plan` picks for rows aligned as
the engine's pages are (`plan`, what the others are compared with), the plan for unaligned rows, the fixed
heuristic (`fixed`: see `fixed_config`; the configuration the H200's kernels.log rows measured), and the plan's
neighbours: half and twice the K tile,
the other column tile, half and twice the splits, the other warp count, 2 and 4 pipeline stages.

Each is timed as the median of 5 replays of one CUDA graph holding `launches` launches, each on its own
copy of the adapter pages (as many copies as twice the L2 needs, at most MAX_COPIES), so the host's launch cost
is out of the figure and the pages come from memory, not L2, as in a decode step where a whole layer's weights
pass between two launches; pages smaller than L2 / MAX_COPIES stay partly in L2 (the row says `L2 warm`).
Rows are printed as they are measured (a part cut short by its time limit keeps them), then a `best` line per
shape. `ok`: this configuration's y equals kernels.reference.lora_delta's.
"""

import math
import time

import torch

from benchmarks.kernel_lora import lora_pages
from benchmarks.kernel_rows import Row, graph_us
from kernels.launch import cdiv

# (projection, tokens, adapters, rank): the decode step of the trace (batch 64, 64 adapters, rank 16) first, then
# shapes that compile nothing new, then those that do (rank 64, a lone token: other tiles)
SHAPES = [("down", 64, 64, 16), ("gate_up", 64, 64, 16), ("qkv", 64, 64, 16), ("o", 64, 64, 16),
          ("gate_up", 16, 16, 8), ("down", 256, 64, 16), ("down", 1, 1, 16), ("down", 64, 64, 64)]
SMOKE_SHAPES = [("down", 4, 2, 8), ("qkv", 1, 1, 8)]
MAX_COPIES = 16


def projections(cfg) -> dict[str, tuple[int, tuple[int, ...]]]:
    kv = cfg["kv_heads"] * cfg["head_dim"]
    return {"qkv": (cfg["hidden"], (cfg["heads"] * cfg["head_dim"], kv, kv)), "o": (cfg["hidden"], (cfg["hidden"],)),
            "gate_up": (cfg["hidden"], (cfg["inter"], cfg["inter"])), "down": (cfg["inter"], (cfg["hidden"],))}


def fixed_config(tokens: int, slots: int, in_dim: int, widths: tuple[int, ...]):
    """Without a cost model: K tiles of 64, column tiles of 64 or 128, and column splits until about 1024 programs
    (benchmarks/gpu-runs/2026-11-28-h200/kernels.log measured these)."""
    from kernels.lora_delta import DeltaConfig

    max_width = max(widths)
    block_n = 64 if max_width <= 64 else 128
    splits = max(1, min(cdiv(max_width, block_n), 1024 // (max(1, min(tokens, slots)) * len(widths))))
    return DeltaConfig(64 if in_dim >= 64 else 32, block_n, splits, 4, 3)


def candidates(tokens: int, slots: int, in_dim: int, widths: tuple[int, ...], rank: int, itemsize: int, sms: int,
               *, smoke: bool = False) -> list[tuple[str, object, int]]:
    """(label, config, row_align) to time, the plan first; aligned rows start at multiples of 16 bytes."""
    import dataclasses

    from kernels.lora_delta import plan

    aligned = 16 // itemsize
    planned = plan(tokens, slots, in_dim, widths, rank, aligned, itemsize, sms)
    unaligned = plan(tokens, slots, in_dim, widths, rank, 1, itemsize, sms)
    out = [("plan", planned, aligned), ("plan for unaligned rows", unaligned, 1),
           ("fixed", fixed_config(tokens, slots, in_dim, widths), 1)]
    if smoke:
        return out + [("splits x 2", dataclasses.replace(planned, splits=planned.splits * 2), aligned)]
    k, n, s = planned.block_k, planned.block_n, planned.splits
    changes = {"bk / 2": {"block_k": max(16, k // 2)}, "bk x 2": {"block_k": min(1024, 2 * k)},
               "other bn": {"block_n": 384 - n if n in (128, 256) else n}, "splits / 2": {"splits": max(1, s // 2)},
               "splits x 2": {"splits": min(cdiv(max(widths), n), 2 * s)},
               "other warps": {"num_warps": 12 - planned.num_warps}, "2 stages": {"num_stages": 2},
               "4 stages": {"num_stages": 4}}
    seen = {planned}
    for label, change in changes.items():
        config = dataclasses.replace(planned, **change)
        if config not in seen:
            seen.add(config)
            out.append((label, config, aligned))
    return out


def lora_config_rows(cfg, device, dtype, ops, *, smoke: bool) -> list[Row]:
    """Time every shape's candidates; print each row as it comes. A time limit's SIGINT ends the sweep early."""
    from kernels.launch import multiprocessor_count
    from kernels.lora_delta import estimate_us

    sms, itemsize = multiprocessor_count(torch.device(device)), torch.tensor([], dtype=dtype).element_size()
    print(f"lora_delta configurations on {sms} SMs: µs per launch, graph replay, each launch on its own copy of the pages")
    print("| shape | candidate | config | rows | µs | estimate µs | plan / this | ok |")
    print("|---|---|---|---|---:|---:|---:|---|", flush=True)
    rows, started = [], time.perf_counter()
    try:
        for name, tokens, adapters, rank in SMOKE_SHAPES if smoke else SHAPES:
            in_dim, widths = projections(cfg)[name]
            shape = f"{name} T={tokens} adapters={adapters} r={rank}"
            case = _Case(ops, in_dim, widths, rank, adapters, tokens, device, dtype)
            measured = []
            for label, config, align in candidates(tokens, adapters, in_dim, widths, rank, itemsize, sms, smoke=smoke):
                us, ok = case.time(config, align)
                plan_us = measured[0][2] if measured else us
                estimate = estimate_us(config, tokens, adapters, in_dim, widths, rank, itemsize, sms)
                measured.append((label, config, us))
                note = " (L2 warm)" if case.warm else ""
                print(f"| {shape} | {label} | {config} | {'aligned' if align > 1 else 'unaligned'}{note} | {us:.1f} "
                      f"| {estimate:.1f} | {plan_us / us:.2f}x | {'yes' if ok else 'NO'} |", flush=True)
                rows.append(Row("lora_delta_config", f"{shape} | {label}: {config} align={align}", us, case.min_bytes,
                                plan_us, ok))
            best = min(measured, key=lambda m: m[2])
            fixed = next(us for label, _, us in measured if label == "fixed")
            print(f"best {shape}: {best[0]} ({best[1]}) {best[2]:.1f} µs; plan {measured[0][2]:.1f} µs; "
                  f"fixed {fixed:.1f} µs ({time.perf_counter() - started:.0f} s so far)", flush=True)
            del case
    except KeyboardInterrupt:  # the suite's time limit: keep what was measured
        print(f"lora_delta configurations: stopped by the time limit after {len(rows)} rows", flush=True)
    return rows


class _Case:
    """One shape's inputs: `copies` copies of the adapter pages (same row tables), x, y, the meta."""

    def __init__(self, ops, in_dim, widths, rank, adapters, tokens, device, dtype):
        num_slices = len(widths)
        offsets = tuple(int(v) for v in torch.tensor((0, *widths)).cumsum(0))
        lora_a = torch.randn(num_slices, adapters, rank, in_dim, device=device, dtype=dtype) / in_dim**0.5
        lora_b = torch.randn(adapters, offsets[-1], rank, device=device, dtype=dtype) / rank**0.5
        pages, self.a_rows, self.b_rows = lora_pages(lora_a, lora_b, offsets)
        aligned = 16 // pages.element_size()
        assert bool((self.a_rows % aligned == 0).all() and (self.b_rows % aligned == 0).all()), "rows not aligned"
        del lora_a, lora_b
        page_bytes = pages.numel() * pages.element_size()
        l2 = torch.cuda.get_device_properties(0).L2_cache_size if device == "cuda" else 0
        self.copies = 1 if device != "cuda" else min(MAX_COPIES, max(2, math.ceil(2 * l2 / page_bytes)))
        self.warm = device == "cuda" and self.copies * page_bytes < 2 * l2
        padded = torch.cat([pages, pages.new_zeros(-pages.numel() % 64)])  # each copy starts 128-byte aligned
        self.pages = padded.repeat(self.copies).view(self.copies, -1)  # [copies, N']
        self.ranks = torch.full((num_slices, adapters), rank, dtype=torch.int32, device=device)
        self.scaling = torch.full((num_slices, adapters), 2.0, device=device)
        self.slots = (torch.arange(tokens, device=device) % adapters).to(torch.int32)
        self.x = torch.randn(tokens, in_dim, device=device, dtype=dtype)
        self.y0 = torch.randn(tokens, offsets[-1], device=device, dtype=dtype)
        self.y = self.y0.clone()
        self.offsets, self.ops, self.device = offsets, ops, device
        self.meta = ops.LoRAMeta.build(self.slots, adapters)
        self.min_bytes = (2 * tokens * offsets[-1] + tokens * in_dim) * self.x.element_size() + page_bytes

    def launch(self, copy: int, config, align: int) -> None:
        self.ops.lora_delta(self.y, self.x, self.pages[copy], self.a_rows, self.b_rows, self.slots, self.ranks,
                            self.scaling, self.offsets, meta=self.meta, row_align=align, config=config)

    def time(self, config, align: int) -> tuple[float, bool]:
        """(µs per launch, whether y agrees with the reference)."""
        from kernels import reference

        self.y.copy_(self.y0)
        self.launch(0, config, align)  # compiles
        expected = self.y0.clone()
        reference.lora_delta(expected, self.x, self.pages[0], self.a_rows, self.b_rows, self.slots, self.ranks,
                             self.scaling, self.offsets)
        ok = bool(torch.allclose(self.y.float(), expected.float(), atol=3e-2, rtol=3e-2))
        return graph_us(lambda i: self.launch(i, config, align), self.copies, self.device), ok
