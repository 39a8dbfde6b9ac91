"""An adapter's rows packed into page chunks (engine/adapter_plan.py): each row starts at a multiple of the memory's
row_align, the promise LoRALinear hands lora_delta for its vector loads, even when the widths are odd."""

import torch

from adapters.loaded import LoadedAdapter
from engine.adapter_plan import AdapterPlan, pages_for_rank
from engine.lora_modules import MODULES, PROJECTIONS
from engine.paged_memory import ROW_ALIGN, PagedMemory

# (in, out) per projection of a toy base whose widths are not multiples of ROW_ALIGN; none of the experts'
ODD = {"q_proj": (37, 37), "k_proj": (37, 13), "v_proj": (37, 13), "o_proj": (37, 37), "gate_proj": (37, 51),
       "up_proj": (37, 51), "down_proj": (51, 37)}
WIDTHS = [ODD.get(module, (0, 0)) for module in MODULES]
LAYERS, RANK = 2, 5


def _adapter() -> LoadedAdapter:
    gen = torch.Generator().manual_seed(4)
    tensors, ranks = {}, {}
    for layer in range(LAYERS):
        for module in PROJECTIONS:
            width_in, width_out = ODD[module]
            key = f"layers.{layer}.{module}"
            ranks[key] = RANK
            tensors[f"{key}.lora_A"] = torch.randn(RANK, width_in, generator=gen)
            tensors[f"{key}.lora_B"] = torch.randn(width_out, RANK, generator=gen)
    return LoadedAdapter(digest="odd", rank=RANK, ranks=ranks, alpha=RANK, scaling=dict.fromkeys(ranks, 1.0),
                         target_modules=list(PROJECTIONS), num_bytes=0, tensors=tensors, config={})


def test_rows_start_at_multiples_of_the_row_alignment_with_odd_widths():
    memory = PagedMemory(num_layers=LAYERS, num_pages=40, block_size=4, kv_heads=2, head_dim=16, dtype=torch.float32,
                         device=torch.device("cpu"))  # chunk 128: every row fits
    adapter = _adapter()
    plan = AdapterPlan.build(adapter, num_layers=LAYERS, widths=WIDTHS, chunk=memory.chunk)
    assert memory.row_align == ROW_ALIGN
    assert plan.num_pages == pages_for_rank(RANK, num_layers=LAYERS, widths=WIDTHS, chunk=memory.chunk)
    pages = torch.randperm(memory.num_pages, generator=torch.Generator().manual_seed(1))[: plan.num_pages].tolist()
    offsets, _ = plan.page_offsets(pages, chunk=memory.chunk, chunk_start=memory.chunk_start, zero_row=memory.zero_row)
    assert (offsets % memory.row_align == 0).all()
    for layer in range(LAYERS):  # placed in its pages, every row reads back what the adapter holds
        memory.flat(layer).view(-1, memory.chunk)[plan.chunk_ids(pages, chunk=memory.chunk,
                                                                  chunk_start=memory.chunk_start)] = plan.chunks[layer]
        for m, module in enumerate(PROJECTIONS):
            for half, name in enumerate(("lora_A", "lora_B")):
                rows = adapter.tensors[f"layers.{layer}.{module}.{name}"]
                rows = rows if half == 0 else rows.t()  # B transposed: one row per rank
                for j in range(RANK):
                    start = int(offsets[layer, m, half, j])
                    assert torch.equal(memory.flat(layer)[start : start + rows.shape[1]], rows[j])


def test_a_chunk_that_is_not_a_multiple_of_the_alignment_lowers_the_promise():
    memory = PagedMemory(num_layers=1, num_pages=4, block_size=3, kv_heads=1, head_dim=4, dtype=torch.float32,
                         device=torch.device("cpu"))  # chunk 12: rows start at multiples of 4 only
    assert memory.chunk == 12 and memory.row_align == 4
