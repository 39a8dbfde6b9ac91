"""Stacked LoRA weights laid out in a flat page memory, rows shuffled, with junk between them and past each rank."""

import torch


def to_pages(lora_a: torch.Tensor, lora_b: torch.Tensor, slice_offsets: tuple[int, ...], gen: torch.Generator,
             align: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lora_a [S, U, R, in], lora_b [U, out_total, R] -> (pages [N], a_rows [S, U, R], b_rows [S, U, R]).

    Every row is copied to a random place in `pages` with junk between, starting at a multiple of `align`; the
    rows at or beyond a slice's rank hold random values too, which the kernels must not read."""
    num_slices, used, max_rank, in_dim = lora_a.shape
    rows = []  # (tensor row, (kind, s, u, j))
    for s in range(num_slices):
        o0, o1 = slice_offsets[s], slice_offsets[s + 1]
        for u in range(used):
            for j in range(max_rank):
                rows.append((lora_a[s, u, j], ("a", s, u, j)))
                rows.append((lora_b[u, o0:o1, j], ("b", s, u, j)))
    order = torch.randperm(len(rows), generator=gen).tolist()
    pieces, where, at = [], {}, 0
    for i in order:
        row, key = rows[i]
        gap = int(torch.randint(0, 3, (1,), generator=gen))
        gap += -(at + gap) % align
        pieces.append(torch.randn(gap, generator=gen).to(row.dtype))
        at += gap
        where[key] = at
        pieces.append(row.cpu())
        at += row.numel()
    pages = torch.cat(pieces + [torch.randn(8, generator=gen).to(lora_a.dtype)]).to(lora_a.device)
    a_rows = torch.zeros(num_slices, used, max_rank, dtype=torch.int64)
    b_rows = torch.zeros(num_slices, used, max_rank, dtype=torch.int64)
    for s in range(num_slices):
        for u in range(used):
            for j in range(max_rank):
                a_rows[s, u, j] = where[("a", s, u, j)]
                b_rows[s, u, j] = where[("b", s, u, j)]
    return pages, a_rows.to(lora_a.device), b_rows.to(lora_a.device)
