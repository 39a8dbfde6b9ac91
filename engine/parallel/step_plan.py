"""What rank 0 sends every worker before each forward pass: the adapter copies since the last step and the
step's model input (token ids and the Context), as plain arrays, so that every rank runs the same batch."""

import pickle
from dataclasses import dataclass

import numpy as np
import torch

from engine.context import Context
from engine.lora_batch import LoRABatch

SAME_LORA = "same"  # the step reuses the previous step's adapters and page tables


@dataclass
class AdapterCopy:
    digest: str
    pages: list[int]


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def encode(input_ids: torch.Tensor, ctx: Context, copies: list[AdapterCopy], *, same_lora: bool) -> bytes:
    lora = None
    if ctx.lora is not None:
        lora = SAME_LORA if same_lora else tuple(_host(t) for t in (ctx.lora.token_slots, ctx.lora.offsets,
                                                                       ctx.lora.ranks, ctx.lora.scaling,
                                                                       ctx.lora.a_source, ctx.lora.expert_offsets))
    fields = (input_ids, ctx.positions, ctx.slot_mapping, ctx.block_tables, ctx.context_lens, ctx.cu_seqlens_q,
              ctx.prompt_lens)
    plan = {"copies": copies, "tensors": [_host(t) for t in fields], "is_decode": ctx.is_decode, "lora": lora}
    return pickle.dumps(plan, protocol=5)


class StepDecoder:
    """The worker's side: rebuilds (copies, input_ids, ctx) on its device, keeping the last LoRABatch for steps
    that reuse it (and with it what the kernels gathered)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.lora: LoRABatch | None = None

    def decode(self, data: bytes) -> tuple[list[AdapterCopy], torch.Tensor, Context]:
        plan = pickle.loads(data)
        dev = self.device
        input_ids, positions, slot_mapping, block_tables, context_lens, cu_seqlens_q, prompt_lens = (
            torch.from_numpy(a).to(dev) for a in plan["tensors"])
        lora = plan["lora"]
        if lora is not None and not isinstance(lora, str):
            slots, offsets, ranks, scaling, a_source, expert_offsets = (torch.from_numpy(a) for a in lora)
            self.lora = LoRABatch.build(slots.to(dev), (offsets.to(dev), ranks, scaling.to(dev), a_source,
                                                        expert_offsets.to(dev)))
        ctx = Context(positions=positions, slot_mapping=slot_mapping, block_tables=block_tables,
                      context_lens=context_lens, cu_seqlens_q=cu_seqlens_q, prompt_lens=prompt_lens,
                      is_decode=plan["is_decode"],
                      lora=None if lora is None else self.lora)
        return plan["copies"], input_ids, ctx
