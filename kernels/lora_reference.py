"""The CPU references of lora_shrink / lora_expand (re-exported by kernels.reference).

Per step (SlotBatch) and per page table, each adapter's rows are gathered once from the page memory
into two dense operands that every later step over the same adapters reuses:
  A: [U, in, S * R] — every slice's A rows side by side, zero at and beyond each slice's rank;
  B: [U, S * R, out] — each slice's B rows in its own output columns (block diagonal), times its scaling;
     or [U, R, out] when the slices share one A (buf holds one slice): every slice's B rows side by side.
How the tokens meet them (SlotGroup, tuned in kernels/slot_batch.py):
  - each adapter's tokens one run of rows (the model runner orders a step so) and few adapters: each run is
    multiplied in place, the expand slice by slice at each slice's own rank (no gather, no padding);
  - else, short runs: gathered adapter by adapter, each padded to the busiest, one batched matmul to shrink
    and one per slice to expand (B's diagonal blocks), then scattered back;
  - else (long runs, prefill): adapter by adapter by index, without padding.
"""

import torch

from kernels.grouped_rows import grouped_rows
from kernels.slot_batch import PER_SLOT_WIDTH, SlotBatch


def _slot_batch(meta, token_slots: torch.Tensor) -> SlotBatch:
    """The step's SlotBatch when given; any other meta (the Triton path's LoRAMeta) is rebuilt from token_slots."""
    return meta if isinstance(meta, SlotBatch) else SlotBatch.build(token_slots)


def _gather(pages: torch.Tensor, rows: torch.Tensor, ranks: torch.Tensor, width: int) -> torch.Tensor:
    """[S, U, R, width] float32: the rows `rows` [S, U, R] points at in flat `pages`, zero at and beyond ranks [S, U]."""
    num_slices, used, max_rank = rows.shape
    last = pages.numel() - width
    view = pages.as_strided((last + 1, width), (1, 1))  # every element offset starts a row of `width`
    keep = torch.arange(max_rank, device=rows.device)[None, None, :] < ranks[:, :, None]  # [S, U, R]
    offsets = torch.where(keep, rows, torch.zeros_like(rows)).clamp_(0, last).reshape(-1).long()
    gathered = view.index_select(0, offsets).view(num_slices, used, max_rank, width).float()
    return gathered.mul_(keep[..., None])


def _group(batch: SlotBatch, ranks: torch.Tensor):
    """batch's SlotGroup for ranks [S, U] (the slots with some slice of rank > 0), found once per ranks tensor:
    every layer of a step asks again with the same tables."""
    return _cached(batch.grouped, (id(ranks),), (ranks,),
                   lambda: batch.group(ranks.amax(0) if ranks.numel() else ranks.new_zeros(0)))


def _slice_ranks(batch: SlotBatch, ranks: torch.Tensor) -> list[list[int]]:
    """ranks [S, U] on the host, per slot: [U][S], once per ranks tensor and step."""
    return _cached(batch.grouped, ("host", id(ranks)), (ranks,), lambda: ranks.t().tolist())


def _unbound(weights: torch.Tensor, batch: SlotBatch) -> tuple[torch.Tensor, ...]:
    """weights [U, ...] as U views, once per dense operand and page table."""
    return _cached(batch.gathered, ("unbound", id(weights)), (weights,), lambda: weights.unbind(0))


def _b_blocks(b: torch.Tensor, ranks: torch.Tensor, slice_offsets, one_a: bool, batch: SlotBatch) -> list[list]:
    """Per slot of dense_b's b [U, S_b * R, o1 - o0]: (slice, first row of h, rank, its B block [rank, w]) for
    each slice it adapts (one_a: one block of every slice's columns, at the slot's largest rank)."""
    def build():
        max_rank = b.shape[1] // (1 if one_a else len(slice_offsets) - 1)
        lo, per_slot = slice_offsets[0], []
        for slot, slot_ranks in enumerate(ranks.t().tolist()):
            if one_a:
                rank = max(slot_ranks)
                per_slot.append([(0, 0, rank, b[slot, :rank])] if rank else [])
                continue
            per_slot.append([(s, s * max_rank, rank, b[slot, s * max_rank : s * max_rank + rank,
                                                       slice_offsets[s] - lo : slice_offsets[s + 1] - lo])
                             for s, rank in enumerate(slot_ranks) if rank])
        return per_slot
    return _cached(batch.gathered, ("blocks", id(b), id(ranks)), (b, ranks), build)


def _diagonal_blocks(b: torch.Tensor, slice_offsets, batch: SlotBatch) -> list[torch.Tensor]:
    """The diagonal blocks of the block-diagonal b [U, S * R, o1 - o0] (dense_b), one per slice: [U, R, w_s]."""
    def build():
        num_slices = len(slice_offsets) - 1
        max_rank, lo = b.shape[1] // num_slices, slice_offsets[0]
        return [b[:, s * max_rank : (s + 1) * max_rank, slice_offsets[s] - lo : slice_offsets[s + 1] - lo].contiguous()
                for s in range(num_slices)]
    return _cached(batch.gathered, ("diagonal", id(b)), (b,), build)


def _cached(cache: dict, key: tuple, held: tuple, build) -> torch.Tensor:
    """cache[key], built once; `held` keeps the tensors whose ids are in key alive meanwhile."""
    if key not in cache:
        cache[key] = (held, build())
    return cache[key][1]


def dense_a(pages, a_rows, ranks, in_dim, batch: SlotBatch) -> torch.Tensor:
    """[U, in, S * R] float32."""
    def build():
        num_slices, used, max_rank = a_rows.shape
        gathered = _gather(pages, a_rows, ranks, in_dim)  # [S, U, R, in]
        return gathered.permute(1, 3, 0, 2).reshape(used, in_dim, num_slices * max_rank).contiguous()
    return _cached(batch.gathered, ("a", id(a_rows), pages.data_ptr()), (a_rows,), build)


def dense_b(pages, b_rows, ranks, scaling, slice_offsets, batch: SlotBatch, *, one_a: bool = False) -> torch.Tensor:
    """[U, S * R, o1 - o0] float32, o0/o1 the first and last slice offsets; [U, R, o1 - o0] when one_a (the
    slices share one A, so one block of R rows holds every slice's B in its own columns)."""
    def build():
        num_slices, used, max_rank = b_rows.shape
        lo = slice_offsets[0]
        blocks = 1 if one_a else num_slices
        shape = (used, blocks, max_rank, slice_offsets[-1] - lo)  # one block: the slices tile its columns
        dense = torch.empty(shape, device=b_rows.device) if one_a else torch.zeros(shape, device=b_rows.device)
        for s in range(num_slices):
            o0, o1 = slice_offsets[s], slice_offsets[s + 1]
            part = _gather(pages, b_rows[s : s + 1], ranks[s : s + 1], o1 - o0)[0]  # [U, R, w_s]
            dense[:, 0 if one_a else s, :, o0 - lo : o1 - lo] = part * scaling[s].float()[:, None, None]
        return dense.view(used, blocks * max_rank, -1)
    key = ("b", id(b_rows), pages.data_ptr(), id(scaling), tuple(slice_offsets), one_a)
    return _cached(batch.gathered, key, (b_rows, scaling), build)


def lora_shrink(
    x: torch.Tensor,
    pages: torch.Tensor,
    a_rows: torch.Tensor,
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
    *,
    meta: object = None,
) -> torch.Tensor:
    """Batched LoRA down-projection over a ragged batch of tokens, reading A through a page table.

    for s in range(S), t in range(T):
        a = token_slots[t]
        buf[s, t, :] = 0
        if a >= 0: for j < ranks[s, a]: buf[s, t, j] = x[t] @ pages[a_rows[s, a, j] : a_rows[s, a, j] + in]

    x [T, in]; pages [N] flat, x.dtype; a_rows [S, U, R] int64 (row j of slice s of the step's adapter a
    starts at that element of pages); token_slots [T] int (-1 = base model); ranks [S, U] int, each
    slice's own rank (0: the adapter leaves that slice alone); returns buf [S, T, R] in x.dtype.
    `meta`: the step's SlotBatch (kernels.lora_meta; built here when None).
    """
    num_slices, _, max_rank = a_rows.shape
    tokens, in_dim = x.shape
    batch = _slot_batch(meta, token_slots)
    group = _group(batch, ranks)
    if group is None:
        return x.new_zeros(num_slices, tokens, max_rank)  # [S, T, R]
    a = dense_a(pages, a_rows, ranks, in_dim, batch)  # [U, in, S * R]
    xs = x if x.dtype == torch.float32 else x.float()
    if group.by_span:  # each adapter's tokens are one run of rows: products written in place
        long_runs = group.width >= PER_SLOT_WIDTH
        rows = xs.new_empty(tokens, num_slices * max_rank) if group.inside is None and not long_runs else \
            xs.new_zeros(tokens, num_slices * max_rank)  # [T, S * R]
        slice_ranks = _slice_ranks(batch, ranks)
        xs_pieces, row_pieces, a_slots = xs.split(group.pieces), rows.split(group.pieces), _unbound(a, batch)
        for slot, (start, end), piece in zip(group.slots, group.spans, group.piece_of, strict=True):
            if end - start < PER_SLOT_WIDTH:  # a short run: every slice at once, padded to R
                torch.mm(xs_pieces[piece], a_slots[slot], out=row_pieces[piece])
                continue
            for s, rank in enumerate(slice_ranks[slot]):  # a long run: each slice at its own rank
                if rank:
                    cols = slice(s * max_rank, s * max_rank + rank)
                    torch.mm(xs[start:end], a[slot, :, cols], out=rows[start:end, cols])
    elif group.per_slot:  # long runs: adapter by adapter, no padding
        rows = xs.new_zeros(tokens, num_slices * max_rank)  # [T, S * R]
        for slot, run in zip(group.slots, group.runs, strict=True):
            rows.index_copy_(0, run, xs.index_select(0, run) @ a[slot])
    else:
        padded = xs if group.identity else xs.index_select(0, group.gather_rows)
        prod = torch.bmm(padded.view(len(group.slots), group.width, in_dim), group.select(a, 0))  # [U', W, S * R]
        rows = prod.view(-1, num_slices * max_rank)
        rows = rows if group.identity else rows.index_select(0, group.scatter_rows)  # [T, S * R]
        if group.inside is not None:
            rows = rows * group.inside
    return rows.to(x.dtype).view(tokens, num_slices, max_rank).transpose(0, 1)  # [S, T, R] (a view)


def lora_expand(
    y: torch.Tensor,
    buf: torch.Tensor,
    pages: torch.Tensor,
    b_rows: torch.Tensor,
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
    scaling: torch.Tensor,
    slice_offsets: tuple[int, ...],
    *,
    meta: object = None,
) -> None:
    """Batched LoRA up-projection added in place, several output slices at once, reading B through a page table.

    for s in range(S), t in range(T):
        a = token_slots[t]; (o0, o1) = slice_offsets[s], slice_offsets[s + 1]; w = o1 - o0
        if a >= 0: for j < ranks[s, a]:
            y[t, o0:o1] += scaling[s, a] * buf[s, t, j] * pages[b_rows[s, a, j] : b_rows[s, a, j] + w]

    (row j of slice s is column j of that slice's B [w, r], stored as a row: B transposed.)
    y [T, out_total] (updated in place); buf [S, T, R]; pages [N] flat; b_rows [S, U, R] int64;
    token_slots [T] int (-1 = base model); ranks [S, U] int; scaling [S, U] float32;
    slice_offsets: S + 1 python ints. `meta`: the step's SlotBatch (built here when None).
    """
    batch = _slot_batch(meta, token_slots)
    group = _group(batch, ranks)
    if group is None:
        return
    buf_slices, tokens, max_rank = buf.shape
    one_a = buf_slices == 1  # buf[0] serves every slice: the slices' B rows are one block
    b = dense_b(pages, b_rows, ranks, scaling, slice_offsets, batch, one_a=one_a)  # [U, S_b * R, out]
    h = buf.transpose(0, 1).reshape(tokens, buf_slices * max_rank).float()  # [T, S_b * R] (shrink's rows: a view)
    lo, hi = slice_offsets[0], slice_offsets[-1]
    if group.by_span and y.dtype == torch.float32:  # each adapter's tokens are one run of rows: added in place
        blocks = _b_blocks(b, ranks, slice_offsets, one_a, batch)  # per slot: (slice, its rows of h, B block)
        widths = [o1 - o0 for o0, o1 in zip(slice_offsets[:-1], slice_offsets[1:], strict=True)]
        h_pieces = h.split(group.pieces)
        y_pieces = (y if (lo, hi) == (0, y.shape[1]) else y[:, lo:hi]).split(group.pieces)
        for slot, piece in zip(group.slots, group.piece_of, strict=True):
            h_piece = h_pieces[piece]
            y_slices = y_pieces[piece].split(widths, dim=1) if len(widths) > 1 and not one_a else (y_pieces[piece],)
            for s, r0, rank, block in blocks[slot]:  # each slice's own block of B, at its own rank
                y_slices[s].addmm_(h_piece.narrow(1, r0, rank), block)
        return
    if group.by_span or group.per_slot:
        delta = h.new_zeros(tokens, hi - lo)
        for slot, run in zip(group.slots, group.runs, strict=True):
            delta.index_copy_(0, run, h.index_select(0, run) @ b[slot])
    else:
        padded = h if group.identity else h.index_select(0, group.gather_rows)
        padded = padded.view(len(group.slots), group.width, -1)  # [U', W, S_b * R]
        if one_a or buf_slices == 1:
            prod = torch.bmm(padded, group.select(b, 0))  # [U', W, out]
        else:  # slice by slice: the zero blocks of the block-diagonal b are not multiplied
            blocks = _diagonal_blocks(b, slice_offsets, batch)
            prod = torch.cat([torch.bmm(padded[:, :, s * max_rank : (s + 1) * max_rank], group.select(block, 0))
                              for s, block in enumerate(blocks)], dim=2)  # [U', W, out]
        delta = prod.view(-1, hi - lo)
        delta = delta if group.identity else delta.index_select(0, group.scatter_rows)  # [T, out]
        if group.inside is not None:
            delta = delta * group.inside
    y[:, lo:hi] += delta.to(y.dtype)


def lora_delta(
    y: torch.Tensor,
    x: torch.Tensor,
    pages: torch.Tensor,
    a_rows: torch.Tensor,
    b_rows: torch.Tensor,
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
    scaling: torch.Tensor,
    slice_offsets: tuple[int, ...],
    *,
    meta: object = None,
    row_align: int = 1,
) -> None:
    """Batched LoRA of a (fused) projection added in place: lora_shrink then lora_expand, in one op.

    for s in range(S), t in range(T):
        a = token_slots[t]; (o0, o1) = slice_offsets[s], slice_offsets[s + 1]
        if a >= 0:
            h = [x[t] @ pages[a_rows[s', a, j] :][:in] for j < ranks[s, a]]     (s' = s, or 0 when a_rows is [1, U, R])
            y[t, o0:o1] += scaling[s, a] * sum_j h[j] * pages[b_rows[s, a, j] :][:o1 - o0]

    y [T, out] (updated in place); x [T, in]; pages [N] flat, x.dtype; a_rows [S or 1, U, R] int64 ([1, ...]: every
    slice reads one A, as a fused-name adapter's slices do); b_rows [S, U, R] int64; token_slots [T' >= T] int
    (-1 = base model; the first T are the tokens'); ranks [S, U] int; scaling [S, U] float32; slice_offsets:
    S + 1 python ints. h is rounded to x.dtype before it meets B (as a two-launch shrink's buffer is).
    `meta`: the step's SlotBatch (kernels.lora_meta; built here when None). `row_align`: the caller's promise that
    the rows start at multiples of it, which lets the Triton launcher use vector loads; nothing here."""
    token_slots = token_slots[: x.shape[0]]
    buf = lora_shrink(x, pages, a_rows, token_slots, ranks[: a_rows.shape[0]], meta=meta)  # [S or 1, T, R]
    lora_expand(y, buf, pages, b_rows, token_slots, ranks, scaling, slice_offsets, meta=meta)


def expert_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    pages: torch.Tensor,
    a_rows: torch.Tensor,
    b_rows: torch.Tensor,
    row_slots: torch.Tensor,
    row_experts: torch.Tensor,
    ranks: torch.Tensor,
    scaling: torch.Tensor,
    slice_offsets: tuple[int, ...],
    *,
    meta: object = None,
) -> None:
    """Each row's LoRA of its adapter's own expert, added in place, over S output slices (gate and up):

    for n in range(N), s in range(S): a, e = row_slots[n], row_experts[n]; (o0, o1) = slice_offsets[s : s + 2]
        if a >= 0: for j < ranks[a]:
            A_j = pages[a_rows[a, e, j] : + in]; B_sj = pages[b_rows[s, a, e, j] : + o1 - o0]  (B^T's row j)
            y[n, o0:o1] += scaling[a] * (x[n] @ A_j) * B_sj

    y [N, out] (updated in place); x [N, in]; pages [P] flat, x.dtype; a_rows [U, E, R] int64; b_rows
    [S, U, E, R] int64; row_slots [N] int (-1 = base model); row_experts [N] int; ranks [U] int (each expert's
    rank, 0: not adapted); scaling [U] float32; slice_offsets: S + 1 python ints from 0 to out.
    `meta`: the step's SlotBatch, which keeps the operands gathered from the pages.
    The reference gathers every (adapter, expert)'s A and B once per page table, sorts the rows by that pair
    (the base model's left out) and takes the two grouped products (kernels.grouped_rows) over the pairs that
    have rows."""
    used, experts, max_rank = a_rows.shape
    rows, in_dim = x.shape
    if rows == 0 or max_rank == 0 or used == 0:
        return
    cache = meta.gathered if isinstance(meta, SlotBatch) else {}
    pairs = used * experts
    padded = -(-max_rank // 4) * 4  # grouped_rows' fast path wants widths of multiples of 4: zero ranks pad

    def dense(rows_table, width, scale):  # [U * E, R', width]
        per_pair = ranks.to(a_rows.device).repeat_interleave(experts).view(1, pairs)  # [1, U * E]
        gathered = _gather(pages, rows_table.reshape(1, pairs, max_rank), per_pair, width)[0]
        if scale is not None:
            gathered *= scale.float().repeat_interleave(experts)[:, None, None]
        return torch.cat([gathered, gathered.new_zeros(pairs, padded - max_rank, width)], dim=1)

    def dense_b():  # the slices side by side: [U * E, R', out]
        widths = [hi - lo for lo, hi in zip(slice_offsets, slice_offsets[1:], strict=False)]
        return torch.cat([dense(b_rows[s], w, scaling) for s, w in enumerate(widths)], dim=2)

    a = _cached(cache, ("expert_a", id(a_rows), pages.data_ptr()), (a_rows,),
                lambda: dense(a_rows, in_dim, None).transpose(1, 2).contiguous())  # [U * E, in, R']
    b = _cached(cache, ("expert_b", id(b_rows), pages.data_ptr(), id(scaling)), (b_rows, scaling), dense_b)
    grouping = (_cached(meta.grouped, ("expert_rows", id(row_slots), id(row_experts), used, experts),
                        (row_slots, row_experts), lambda: _pair_rows(row_slots, row_experts, used, experts))
                if isinstance(meta, SlotBatch) else _pair_rows(row_slots, row_experts, used, experts))
    if grouping is None:  # every row the base model's
        return
    order, present, bounds = grouping
    h = grouped_rows(x.index_select(0, order), a.index_select(0, present), bounds)  # [n, R']
    y.index_add_(0, order, grouped_rows(h, b.index_select(0, present), bounds).to(y.dtype))


def _pair_rows(row_slots: torch.Tensor, row_experts: torch.Tensor, used: int, experts: int):
    """(order [n]: the adapted rows sorted by (adapter, expert) pair, present [P']: the pairs that have rows,
    bounds [P' + 1]: where each one's rows start in order), or None when no row is adapted. One per layer of a
    step: its two projections share it (kept in the step's SlotBatch)."""
    pairs = used * experts
    pair = torch.where(row_slots >= 0, row_slots.long() * experts + row_experts.long(), pairs)  # [N]
    counts = torch.bincount(pair, minlength=pairs + 1)[:pairs]  # [U * E] (the base model's rows dropped)
    present = torch.nonzero(counts).flatten()  # [P']
    if present.numel() == 0:
        return None
    bounds = torch.zeros(present.numel() + 1, dtype=torch.int64, device=pair.device)
    bounds[1:] = torch.cumsum(counts[present], 0)
    order = torch.argsort(pair, stable=True)[: int(bounds[-1])]
    return order, present, bounds
