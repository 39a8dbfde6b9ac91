"""LoRABatch: the step's LoRA metadata in buffers allocated once and refilled in place (engine/lora_batch.py).
An adapter keeps its slot while it stays in the same pages, so a step with the same adapters copies no table,
and the views the forward reads (the Triton path's) keep their storage from step to step."""

import pytest
import torch

import kernels
from engine.lora_batch import AdapterTables, LoRABatch
from engine.lora_modules import EXPERT_INDEX, MODULES

LAYERS, DENSE, MODULE_COUNT = 2, EXPERT_INDEX[0], len(MODULES)


def tables(key: int, rank: int) -> AdapterTables:
    """An adapter whose every row offset is key * 1000 + its position, rank `rank` on q/k/v."""
    offsets = key * 1000 + torch.arange(LAYERS * DENSE * 2 * rank).view(LAYERS, DENSE, 2, rank)
    ranks = torch.zeros(LAYERS, MODULE_COUNT, dtype=torch.int32)
    ranks[:, :3] = rank
    return AdapterTables(key=key, offsets=offsets, expert_offsets=torch.zeros(LAYERS, 2, 2, 0, dtype=torch.int64),
                         ranks=ranks, scaling=torch.full((LAYERS, MODULE_COUNT), float(key)), host_ranks=ranks,
                         a_source=torch.arange(MODULE_COUNT).repeat(LAYERS, 1))


@pytest.fixture
def triton_path():
    kernels.route_cpu_to_triton(True)  # the launchers' path: no kernel runs in these tests
    yield
    kernels.route_cpu_to_triton(False)


def storage(lora: LoRABatch) -> dict[str, int]:
    qkv = lora.module(0, 0, 3)
    return {"meta": lora.meta.packed.data_ptr(), "tokens": lora.token_slots.data_ptr(),
            **{name: getattr(qkv, name).data_ptr() for name in ("a_rows", "b_rows", "ranks", "scaling")}}


def test_adapters_keep_their_slots_and_only_new_ones_are_copied(triton_path):
    lora = LoRABatch(num_layers=LAYERS, device=torch.device("cpu"), zero_row=7)
    a, b, c, d = (tables(key, rank) for key, rank in ((1, 4), (2, 8), (3, 2), (4, 8)))
    lora.fill([0, 1, -1, 2, 0], [a, b, c])
    first = list(lora.step_slots)  # a's, b's, base, c's, a's
    assert len(lora.writes) == 3 and lora.step_slots[2] == -1
    before = storage(lora)
    lora.fill([1, 0], [c, a])  # the same adapters, other tokens: nothing copied
    assert lora.writes == [] and storage(lora) == before
    assert lora.step_slots == [first[0], first[3]]
    lora.fill([0, 1, 2], [a, d, c])  # d is new: one slot written, a free one (b's tables stay, should b return)
    assert [slot for slot, _ in lora.writes] == [lora.step_slots[1]] and storage(lora) == before
    assert lora.step_slots[1] not in first
    qkv = lora.module(1, 0, 3)
    slot_d = lora.step_slots[1]
    assert qkv.ranks[:, slot_d].tolist() == [8, 8, 8] and qkv.scaling[0, slot_d] == 4.0
    assert torch.equal(qkv.a_rows[0, slot_d, :8], d.offsets[1, 0, 0])  # layer 1, q, A rows
    assert torch.equal(qkv.b_rows[2, slot_d, :8], d.offsets[1, 2, 1])  # layer 1, v, rows of B transposed
    assert (qkv.a_rows[0, slot_d, 8:] == 7).all()  # past its rank: the zero row
    assert lora.meta.slot_counts[slot_d] == 1 and lora.token_slots.tolist() == lora.step_slots


def test_a_bigger_step_grows_the_buffers_keeping_every_slot(triton_path):
    lora = LoRABatch(num_layers=LAYERS, device=torch.device("cpu"), zero_row=7)
    a = tables(1, 4)
    lora.fill([0], [a])
    slot = lora.step_slots[0]
    many = [tables(key, 32) for key in range(2, 12)]  # more adapters and a larger rank than reserved
    lora.fill(list(range(11)) + [-1] * 20, [a, *many])
    assert lora.max_adapters == 16 and lora.max_rank == 32 and lora.max_tokens == 32
    assert lora.step_slots[0] == slot and len(lora.writes) == 10  # a kept its slot and its tables
    qkv = lora.module(0, 0, 3)
    assert torch.equal(qkv.a_rows[0, slot, :4], a.offsets[0, 0, 0]) and (qkv.a_rows[0, slot, 4:] == 7).all()
    reserved = storage(lora)
    lora.fill([0, 1], [many[3], many[5]])  # within what is reserved: no buffer moves
    assert storage(lora) == reserved


def test_the_reference_path_cuts_tables_for_the_steps_slots():
    lora = LoRABatch(num_layers=LAYERS, device=torch.device("cpu"), zero_row=7)
    lora.fill([0, 1], [tables(1, 4), tables(2, 2)])
    qkv = lora.module(0, 0, 3)
    assert qkv.a_rows.shape == (3, 2, 4) and qkv.ranks.tolist() == [[4, 2]] * 3
    assert lora.module(0, 3, 1) is None  # o_proj: no adapter of the step has it
