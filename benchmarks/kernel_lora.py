"""benchmarks/kernels.py's LoRA rows: the fused lora_delta the engine runs (one launch per projection group, its
rows 16-byte aligned as the engine's pages are), and the split shrink/expand pair it replaced, each against
gathered adapter weights + bmm in plain PyTorch."""

import torch

from benchmarks.kernel_rows import Row, measure


def lora_rows(cfg, grid, device, dtype, ops) -> list[Row]:
    projections = {
        "qkv": (cfg["hidden"], (cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"],
                                cfg["kv_heads"] * cfg["head_dim"])),
        "down": (cfg["inter"], (cfg["hidden"],)),
    }  # fmt: skip
    rows = []
    for name, (in_dim, slices) in projections.items():
        for rank in grid["ranks"]:
            for adapters in grid["adapters"]:
                for batch in grid["batches"]:
                    if adapters <= batch:
                        rows += lora_case(ops, name, in_dim, slices, rank, adapters, batch, device, dtype)
    return rows


def lora_pages(lora_a, lora_b, offsets):
    """One flat page buffer holding every adapter's A rows and B-transposed rows, and the row tables into it.

    lora_a [S, U, R, in], lora_b [U, out_total, R] -> pages [N], a_rows [S, U, R], b_rows [S, U, R] (int64)."""
    num_slices, adapters, rank, in_dim = lora_a.shape
    device = lora_a.device
    rows = torch.arange(num_slices * adapters * rank, device=device, dtype=torch.int64)
    a_rows = (rows * in_dim).view(num_slices, adapters, rank)
    chunks, b_rows, start = [lora_a.reshape(-1)], [], lora_a.numel()
    for s in range(num_slices):
        width = offsets[s + 1] - offsets[s]
        bt = lora_b[:, offsets[s] : offsets[s + 1]].transpose(1, 2).contiguous()  # [U, R, width]
        chunks.append(bt.reshape(-1))
        b_rows.append(start + torch.arange(adapters * rank, device=device, dtype=torch.int64).view(adapters, rank) * width)
        start += bt.numel()
    return torch.cat(chunks), a_rows.contiguous(), torch.stack(b_rows).contiguous()


def lora_case(ops, name, in_dim, slices, rank, adapters, batch, device, dtype) -> list[Row]:
    """Shrink and expand for `batch` decode tokens spread round-robin over `adapters` adapters, whose rows the
    kernels read through page tables (the engine's layout); the baselines use dense stacked weights."""
    es = torch.tensor([], dtype=dtype).element_size()
    out_total, num_slices = sum(slices), len(slices)
    offsets = tuple(int(v) for v in torch.tensor((0, *slices)).cumsum(0))
    lora_a = torch.randn(num_slices, adapters, rank, in_dim, device=device, dtype=dtype) / in_dim**0.5
    lora_b = torch.randn(adapters, out_total, rank, device=device, dtype=dtype) / rank**0.5
    pages, a_rows, b_rows = lora_pages(lora_a, lora_b, offsets)
    ranks = torch.full((num_slices, adapters), rank, dtype=torch.int32, device=device)
    scaling = torch.full((num_slices, adapters), 2.0, device=device)
    slots = (torch.arange(batch, device=device) % adapters).to(torch.int32)
    x = torch.randn(batch, in_dim, device=device, dtype=dtype)
    y0 = torch.randn(batch, out_total, device=device, dtype=dtype)
    y = y0.clone()
    meta = ops.LoRAMeta.build(slots, adapters)
    shape = f"{name} T={batch} adapters={adapters} r={rank}"
    buf = ops.lora_shrink(x, pages, a_rows, slots, ranks, meta=meta)

    def expand():
        ops.lora_expand(y, buf, pages, b_rows, slots, ranks, scaling, offsets, meta=meta)

    def expand_baseline():
        gathered = lora_b[slots.long()]  # [T, out_total, r]
        for s in range(num_slices):
            delta = torch.bmm(gathered[:, offsets[s] : offsets[s + 1]], buf[s, :, :, None])  # [T, width, 1]
            y[:, offsets[s] : offsets[s + 1]] += 2.0 * delta.squeeze(-1)

    def expanded(run):
        y.copy_(y0)
        run()
        return y.clone()

    aligned = 16 // es  # lora_pages' rows start at multiples of 16 bytes here, as the engine's pages do
    assert bool((a_rows % aligned == 0).all() and (b_rows % aligned == 0).all()), "rows not aligned"

    def delta():
        ops.lora_delta(y, x, pages, a_rows, b_rows, slots, ranks, scaling, offsets, meta=meta, row_align=aligned)

    def delta_baseline():
        gathered_a = lora_a[:, slots.long()]  # [S, T, r, in]
        gathered_b = lora_b[slots.long()]  # [T, out_total, r]
        for s in range(num_slices):
            shrunk = torch.matmul(gathered_a[s], x[:, :, None])  # [T, r, 1]
            y[:, offsets[s] : offsets[s + 1]] += 2.0 * torch.bmm(gathered_b[:, offsets[s] : offsets[s + 1]], shrunk).squeeze(-1)

    return [
        measure(  # what the engine runs: one launch per projection group, x @ A.T recomputed per column block
            "lora_delta", shape, delta, delta_baseline,
            (2 * batch * out_total + batch * in_dim + adapters * rank * (num_slices * in_dim + out_total)) * es,
            out=lambda: expanded(delta), base_out=lambda: expanded(delta_baseline),
        ),
        measure(
            "lora_shrink", shape, lambda: ops.lora_shrink(x, pages, a_rows, slots, ranks, meta=meta),
            lambda: torch.matmul(lora_a[:, slots.long()], x[None, :, :, None]).squeeze(-1),
            (batch * in_dim + adapters * num_slices * rank * in_dim + num_slices * batch * rank) * es,
        ),
        measure(
            "lora_expand", shape, expand, expand_baseline,
            (2 * batch * out_total + adapters * out_total * rank + num_slices * batch * rank) * es,
            out=lambda: expanded(expand), base_out=lambda: expanded(expand_baseline),
        ),
    ]  # fmt: skip
