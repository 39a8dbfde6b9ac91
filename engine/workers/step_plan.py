"""What rank 0 sends every worker before each forward pass: the adapter copies since the last step and the
step's model input (token ids and the Context), as plain arrays, so that every rank runs the same batch."""

import pickle
from dataclasses import dataclass

import numpy as np
import torch

from engine.context import Context
from engine.lora_batch import AdapterTables, LoRABatch


@dataclass
class AdapterCopy:
    digest: str
    pages: list[int]


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def encode(input_ids: torch.Tensor, ctx: Context, copies: list[AdapterCopy]) -> bytes:
    lora = None
    if ctx.lora is not None:  # the step's token -> slot, and the tables of the slots the step's fill wrote
        lora = (ctx.lora.step_slots, [(slot, tuple(_host(t) for t in (tables.offsets, tables.expert_offsets,
                                                                        tables.host_ranks, tables.scaling,
                                                                        tables.a_source)))
                                      for slot, tables in ctx.lora.writes])
    fields = (input_ids, ctx.positions, ctx.slot_mapping, ctx.block_tables, ctx.context_lens, ctx.cu_seqlens_q,
              ctx.prompt_lens)
    plan = {"copies": copies, "tensors": [_host(t) for t in fields], "is_decode": ctx.is_decode, "lora": lora}
    return pickle.dumps(plan, protocol=5)


class StepDecoder:
    """The worker's side: rebuilds (copies, input_ids, ctx) on its device, with its own LoRABatch whose slots
    mirror rank 0's (engine.lora_batch)."""

    def __init__(self, device: torch.device, *, num_layers: int, zero_row: int, num_experts: int) -> None:
        self.device = device
        self.lora = LoRABatch(num_layers=num_layers, device=device, zero_row=zero_row, num_experts=num_experts)

    def decode(self, data: bytes) -> tuple[list[AdapterCopy], torch.Tensor, Context]:
        plan = pickle.loads(data)
        dev = self.device
        input_ids, positions, slot_mapping, block_tables, context_lens, cu_seqlens_q, prompt_lens = (
            torch.from_numpy(a).to(dev) for a in plan["tensors"])
        lora = plan["lora"]
        if lora is not None:
            token_slots, writes = lora
            written = []
            for slot, (offsets, expert_offsets, ranks, scaling, a_source) in writes:
                ranks, scaling = torch.from_numpy(ranks), torch.from_numpy(scaling)
                written.append((slot, AdapterTables(
                    key=-1, offsets=torch.from_numpy(offsets).to(dev), expert_offsets=torch.from_numpy(expert_offsets).to(dev),
                    ranks=ranks.to(dev), scaling=scaling.to(dev), host_ranks=ranks, a_source=torch.from_numpy(a_source))))
            self.lora.fill_slots(token_slots, written)
        ctx = Context(positions=positions, slot_mapping=slot_mapping, block_tables=block_tables,
                      context_lens=context_lens, cu_seqlens_q=cu_seqlens_q, prompt_lens=prompt_lens,
                      is_decode=plan["is_decode"], lora=None if lora is None else self.lora)
        return plan["copies"], input_ids, ctx
