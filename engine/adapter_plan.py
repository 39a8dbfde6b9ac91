"""An adapter laid out for paged memory: every module at its own rank, rows packed into page chunks.

A page is, per layer, two chunks of `chunk` elements (paged_memory). An adapter's layer-l rows — for
each targeted module its r rows of A (width in_features) and its r rows of B transposed (width
out_features); slices that share one A, as a fused-name module's do, share its rows — are packed one after
another into chunks 0, 1, 2, ... of that layer, each at a multiple of ROW_ALIGN values (the LoRA kernels'
vector loads; no gap when the widths are multiples of it), a row never straddling two chunks. Chunk j of
every layer lives in page pages[j // 2], half j % 2, so an adapter needs ceil(most chunks of any layer / 2)
pages, the same page ids in every layer. The host copy is kept as those chunks already packed
([L, 2 * pages, chunk]), so that placing the adapter in its pages is one copy of whole chunks per layer.

An expert module (lora_modules.EXPERT_INDEX) has E * r rows of A, expert e's at e * r .. e * r + r - 1, and
S * E * r rows of B transposed, one block of E * r per output slice (EXPERT_SLICES: gate_up's gate and up
halves), ordered alike (PEFT stacks B's columns the other way round, j * E + e: they are reordered here).
"""

from dataclasses import dataclass

import torch

import adapters
from engine.lora_modules import EXPERT_INDEX, EXPERT_SLICES, MODULE_INDEX, MODULES
from engine.paged_memory import ROW_ALIGN


@dataclass
class AdapterPlan:
    digest: str
    num_pages: int
    max_rank: int
    expert_rows: int  # the most rows of an expert module's half (E * r, or S * E * r of B's slices); 0: none
    ranks: torch.Tensor  # [L, M] int32, 0: module not targeted (host); an expert module's: each expert's
    a_source: torch.Tensor  # [L, M] int64 (host): the module whose A rows each module reads (itself, or an earlier
    # slice of the same fused-name module, whose one A the slices share)
    scaling: torch.Tensor  # [L, M] float32 (host)
    local: torch.Tensor  # [L, M', 2, max_rank] int64: chunk * chunk_size + offset of each A / B^T row (-1: none)
    # of the modules before the experts' (M' of them)
    expert_local: torch.Tensor  # [L, 2, 2, expert_rows] int64: the same for the experts' two modules (their own
    # table: E times the rows, which the other modules' would otherwise be padded to)
    chunks: torch.Tensor  # [L, 2 * num_pages, chunk] (host): every layer's rows packed as `local` says, zero between
    num_bytes: int

    @classmethod
    def build(cls, adapter: "adapters.LoadedAdapter", *, num_layers: int, widths: list[tuple[int, int]],
              chunk: int, pin: bool = False) -> "AdapterPlan":
        """Check every tensor against the base model's shapes (AdapterError if not) and pack the rows."""
        num_modules = len(MODULES)
        ranks = torch.zeros(num_layers, num_modules, dtype=torch.int32)
        num_rows = [[(0, 0)] * num_modules for _ in range(num_layers)]  # of A, of B transposed
        scaling = torch.zeros(num_layers, num_modules, dtype=torch.float32)
        rows: dict[tuple[int, int, int], torch.Tensor] = {}
        for key, rank in adapter.ranks.items():
            layer, module = _parse(key, num_layers)
            a, b = adapter.tensors.get(f"{key}.lora_A"), adapter.tensors.get(f"{key}.lora_B")
            width_in, width_out = widths[module]
            count = a.shape[0] if module in EXPERT_INDEX and a is not None and a.shape[0] % rank == 0 else rank
            slices = EXPERT_SLICES.get(module, 1)
            if a is None or b is None or tuple(a.shape) != (count, width_in) or tuple(b.shape) != (
                    slices * width_out, count):
                got = [tuple(t.shape) if t is not None else None for t in (a, b)]
                raise adapters.AdapterError(
                    "shape_mismatch", f"{key} has lora_A/lora_B of shapes {got}; this base model needs "
                    f"{(count, width_in)} and {(slices * width_out, count)}")
            ranks[layer, module] = rank
            num_rows[layer][module] = (count, slices * count)
            scaling[layer, module] = float(adapter.scaling[key])
            rows[(layer, module, 0)] = a
            bt = b.t()  # [rows, out]
            if module in EXPERT_INDEX:  # PEFT's row j * E + e -> e * r + j, then each slice's block of rows
                bt = bt.reshape(rank, count // rank, slices * width_out).transpose(0, 1).reshape(count, -1)
                bt = torch.cat(bt.split(width_out, dim=1))  # [S * E * r, out / S]
            rows[(layer, module, 1)] = bt
        max_rank = int(ranks.max()) if ranks.numel() else 0
        expert_rows = max((max(layer_rows[m]) for layer_rows in num_rows for m in EXPERT_INDEX), default=0)
        if max_rank == 0:
            raise adapters.AdapterError("empty_adapter", "the adapter targets no module of this model")
        local = [[[[-1] * count for count in num_rows[layer][module]] for module in range(num_modules)]
                 for layer in range(num_layers)]  # ragged: each module's own rows
        a_source = [list(range(num_modules)) for _ in range(num_layers)]
        most_chunks = 0
        for layer in range(num_layers):
            at = 0  # element position in this layer's chunk sequence
            for module in range(num_modules):
                for half in (0, 1):
                    width, out = widths[module][half], local[layer][module][half]
                    shared = _shared_a(rows, layer, module) if half == 0 else None
                    if shared is not None:  # a fused-name adapter's slices share one A: its rows once
                        out[:] = local[layer][shared][0][: len(out)]
                        a_source[layer][module] = shared
                        continue
                    for j in range(num_rows[layer][module][half]):
                        at = _next_row(at, width, chunk)
                        out[j] = at
                        at += width
            most_chunks = max(most_chunks, -(-at // chunk))
        num_pages = -(-most_chunks // 2)
        dtype = next(iter(rows.values())).dtype
        # [L, chunks * chunk], pinned from the start on CUDA (no second, pinned copy); each run of rows that lie
        # end to end is one copy from the tensors read (views of the file's one buffer)
        chunks = torch.zeros(num_layers, 2 * num_pages * chunk, dtype=dtype, pin_memory=pin)
        for (layer, module, half), part in rows.items():
            at = local[layer][module][half][: part.shape[0]]
            width, first = part.shape[1], 0
            if not part.is_contiguous():  # B transposed: row by row (torch copies a strided 2-D block 20x slower)
                for j, start in enumerate(at):
                    chunks[layer, start : start + width].copy_(part[j])
                continue
            for j in range(1, len(at) + 1):
                if j == len(at) or at[j] != at[j - 1] + width:
                    chunks[layer, at[first] : at[j - 1] + width].view(j - first, width).copy_(part[first:j])
                    first = j
        chunks = chunks.view(num_layers, 2 * num_pages, chunk)
        first_expert = EXPERT_INDEX[0]
        return cls(digest=adapter.digest, num_pages=num_pages, max_rank=max_rank, expert_rows=expert_rows,
                   ranks=ranks, a_source=torch.tensor(a_source, dtype=torch.int64), scaling=scaling,
                   local=_padded([layer[:first_expert] for layer in local], max_rank),
                   expert_local=_padded([layer[first_expert:] for layer in local], expert_rows), chunks=chunks,
                   num_bytes=chunks.numel() * chunks.element_size())

    def chunk_ids(self, pages: list[int], *, chunk: int, chunk_start) -> torch.Tensor:
        """[2 * num_pages] int64: where each of `chunks`' chunks goes once placed in `pages`, as an index into
        a layer's memory viewed as rows of `chunk` elements."""
        return torch.tensor([chunk_start(pages[j // 2], j % 2) // chunk for j in range(2 * len(pages))],
                            dtype=torch.int64)

    def page_offsets(self, pages: list[int], *, chunk: int, chunk_start, zero_row: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The page tables of this adapter once placed in `pages`, element offsets into each layer's flat memory
        (zero_row where a module has no such row): [L, M', 2, max_rank] of `local`, [L, 2, 2, expert_rows] of
        `expert_local`."""
        starts = torch.tensor([chunk_start(pages[j // 2], j % 2) for j in range(2 * len(pages))], dtype=torch.int64)

        def placed(local: torch.Tensor) -> torch.Tensor:
            absent = local < 0
            clamped = local.clamp(min=0)
            return (starts[clamped // chunk] + clamped % chunk).masked_fill_(absent, zero_row)

        return placed(self.local), placed(self.expert_local)


def _next_row(at: int, width: int, chunk: int) -> int:
    """Where a row of `width` values goes at or after `at`: the next multiple of ROW_ALIGN, or the next chunk when
    the row would straddle two."""
    at = -(-at // ROW_ALIGN) * ROW_ALIGN
    return at if at % chunk + width <= chunk else (at // chunk + 1) * chunk


def _padded(rows: list, width: int) -> torch.Tensor:
    """[L, M, 2, width] int64 of ragged per-(layer, module, half) row lists, -1 past each list's end."""
    return torch.tensor([[[half + [-1] * (width - len(half)) for half in module] for module in layer] for layer in rows],
                        dtype=torch.int64)


def _shared_a(rows: dict[tuple[int, int, int], torch.Tensor], layer: int, module: int) -> int | None:
    """An earlier module of the layer whose lora_A is this module's very tensor (the slices of a fused-name
    module: engine.lora_modules.per_slice), or None."""
    a = rows.get((layer, module, 0))
    return next((m for m in range(module) if a is not None and rows.get((layer, m, 0)) is a), None)


def _parse(key: str, num_layers: int) -> tuple[int, int]:
    try:
        _, layer, module = key.split(".")
        layer_index, module_index = int(layer), MODULE_INDEX[module]
    except (ValueError, KeyError):
        raise adapters.AdapterError("module_unsupported", f"adapter targets {key}, which this model lacks") from None
    if not 0 <= layer_index < num_layers:
        raise adapters.AdapterError("module_unsupported", f"adapter targets {key}; this model has {num_layers} layers")
    return layer_index, module_index


def pages_for_rank(rank: int, *, num_layers: int, widths: list[tuple[int, int]], chunk: int,
                   num_experts: int = 0) -> int:
    """Pages of an adapter of this rank on every projection, the experts' included (how the default adapter
    memory is sized)."""
    at = 0
    for module, (width_in, width_out) in enumerate(widths):
        for half, width in enumerate((width_in, width_out)):
            rows = rank
            if module in EXPERT_INDEX:
                rows = rank * num_experts * (EXPERT_SLICES[module] if half else 1)
            for _ in range(rows):
                at = _next_row(at, width, chunk) + width
    chunks = -(-at // chunk)
    return -(-chunks // 2)
