"""The CPU references' LoRA layouts (one padded batched matmul, slot by slot for wide slots, or run by run when
each slot's tokens are one run of rows) against a per-token loop."""

import pytest
import torch

from kernels import SlotBatch, reference
from kernels import slot_batch as slot_batch_module
from tests.kernels.paged_lora import to_pages


def _naive(x, lora_a, lora_b, ranks, token_slots, scaling, offsets, y0):
    buf = torch.zeros(lora_a.shape[0], x.shape[0], lora_a.shape[2], dtype=torch.float64)
    y = y0.double().clone()
    for t, a in enumerate(token_slots.tolist()):
        if a < 0:
            continue
        for s in range(len(offsets) - 1):
            r = int(ranks[s, a])
            buf[s, t, :r] = lora_a[s, a, :r].double() @ x[t].double()
            o0, o1 = offsets[s], offsets[s + 1]
            y[t, o0:o1] += float(scaling[s, a]) * (lora_b[a, o0:o1, :r].double() @ buf[s, t, :r])
    return buf.float(), y.float()


@pytest.mark.parametrize("order", ["shuffled", "by-adapter", "by-adapter-short-runs"])
@pytest.mark.parametrize("layout", ["native", "padded-forced", "per-slot-forced"])
def test_every_layout_matches_a_per_token_loop(layout, order, monkeypatch):
    if layout == "padded-forced":
        monkeypatch.setattr(slot_batch_module, "PER_SLOT_WIDTH", 10**9)
        monkeypatch.setattr(slot_batch_module, "SPAN_MAX_SLOTS", 0)
    elif layout == "per-slot-forced":
        monkeypatch.setattr(slot_batch_module, "PER_SLOT_WIDTH", 1)
    gen = torch.Generator().manual_seed(5)
    slices, slots, max_rank, in_dim = (12, 5, 7), 4, 8, 20
    # slot 0 is wide (80 tokens: the slot-by-slot layout natively), slot 2 has rank 0, -1 is the base model;
    # by adapter (as the model runner orders a step), each slot's tokens are one run of rows
    token_slots = torch.tensor([0] * 80 + [1] * 9 + [2] * 4 + [-1] * 6 + [3] * 3)
    if order == "shuffled":
        token_slots = token_slots[torch.randperm(102, generator=gen)]
    elif order == "by-adapter-short-runs":  # a slot left out first, base-model rows last
        token_slots = torch.tensor([2] * 4 + [0] * 9 + [1] * 5 + [-1] * 6)
    # [S, U]: each slice at its own rank; slot 1 leaves slice 1 alone, slot 3 slice 2
    ranks = torch.tensor([[8, 3, 0, 5], [7, 0, 0, 2], [8, 1, 0, 0]])
    x = torch.randn(token_slots.shape[0], in_dim, generator=gen)
    lora_a = torch.randn(len(slices), slots, max_rank, in_dim, generator=gen)  # random beyond each rank
    lora_b = torch.randn(slots, sum(slices), max_rank, generator=gen)
    scaling = torch.rand(len(slices), slots, generator=gen) + 0.5
    offsets = tuple(int(v) for v in torch.tensor((0, *slices)).cumsum(0))
    y0 = torch.randn(x.shape[0], offsets[-1], generator=gen)
    meta = SlotBatch.build(token_slots)
    pages, a_rows, b_rows = to_pages(lora_a, lora_b, offsets, gen)
    buf = reference.lora_shrink(x, pages, a_rows, token_slots, ranks, meta=meta)
    y = y0.clone()
    reference.lora_expand(y, buf, pages, b_rows, token_slots, ranks, scaling, offsets, meta=meta)
    expect_buf, expect_y = _naive(x, lora_a, lora_b, ranks, token_slots, scaling, offsets, y0)
    group = meta.group(ranks.amax(0))
    assert group.per_slot == (layout == "per-slot-forced" or (layout == "native" and order != "by-adapter-short-runs"))
    assert group.by_span == (order != "shuffled" and layout != "padded-forced")
    torch.testing.assert_close(buf, expect_buf, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y, expect_y, rtol=1e-4, atol=1e-4)
