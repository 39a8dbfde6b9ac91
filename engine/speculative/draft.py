"""Draft-model proposer: a smaller checkpoint with the target's tokenizer proposes k tokens autoregressively.

The draft has its own PagedMemory with as many pages as the target's pool and the same block size, and
writes its KV into the same page ids through the target's block tables: it needs no block manager of its
own, and the lookahead slots the scheduler reserved hold its proposals' KV too. Per sequence it remembers
how many tokens its cache holds (valid while the sequence keeps its blocks: a preemption starts it over);
each step it first catches up on the tokens it has not seen, then proposes. It runs the base draft model:
draft-side adapters are not supported (docs/speculative.md).
"""

from dataclasses import dataclass

import torch

from engine.context import Context
from engine.models import CausalLM
from engine.paged_memory import PagedMemory
from engine.sequence import Sequence
from engine.speculative.rejection import draw


@dataclass
class DraftCache:
    num_tokens: int  # tokens of the sequence whose draft KV is in its pages
    num_preemptions: int  # the sequence's count when they were written (a preemption changes its pages)


class DraftProposer:
    def __init__(self, *, model: CausalLM, num_pages: int, block_size: int, runner) -> None:
        args = model.spec
        self.model = model
        self.block_size = block_size
        self.runner = runner  # the target's ModelRunner: sampler, sample requests, seeded generators
        self.device = model.lm_head.weight.device
        self.memory = PagedMemory(num_layers=args.num_layers, num_pages=num_pages, block_size=block_size,
                                  kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                                  dtype=model.lm_head.weight.dtype, device=self.device)
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = self.memory.kv_cache(i)
        self.caches: dict[int, DraftCache] = {}  # seq_id -> what its pages hold of the draft's KV

    def release(self, seq: Sequence) -> None:
        self.caches.pop(seq.seq_id, None)

    def _cached(self, seq: Sequence) -> int:
        cache = self.caches.get(seq.seq_id)
        if cache is None or cache.num_preemptions != seq.num_preemptions:
            return 0
        return min(cache.num_tokens, seq.num_computed_tokens)  # tokens past it were rejected proposals

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], lookahead: dict[int, int]) -> tuple[dict[int, list[int]], dict]:
        seqs = [seq for seq in seqs if lookahead.get(seq.seq_id, 0) > 0]
        if not seqs:
            return {}, {}
        tokens = {seq.seq_id: [] for seq in seqs}
        probs: dict[int, list[torch.Tensor]] = {seq.seq_id: [] for seq in seqs}
        # catch up on every token not yet seen (the whole prompt the first time), then one token at a time
        rows = [(seq, seq.token_ids[self._cached(seq):], self._cached(seq)) for seq in seqs]
        for step in range(max(lookahead[seq.seq_id] for seq in seqs)):
            logits = self._forward(rows)  # [len(rows), vocab]
            for (seq, _, _), row in zip(rows, logits, strict=True):
                token, q = self._choose(seq, row, tokens[seq.seq_id])
                tokens[seq.seq_id].append(token)
                probs[seq.seq_id].append(q)
            rows = [(seq, [tokens[seq.seq_id][-1]], seq.num_tokens + step) for seq, _, _ in rows
                    if len(tokens[seq.seq_id]) < lookahead[seq.seq_id]]
            if not rows:
                break
        for seq in seqs:
            self.caches[seq.seq_id] = DraftCache(seq.num_tokens + len(tokens[seq.seq_id]) - 1, seq.num_preemptions)
        sampled = {i: torch.stack(q) for i, q in probs.items() if q[0] is not None}  # [k, vocab] each
        return tokens, sampled

    def _choose(self, seq: Sequence, logits: torch.Tensor, proposed: list[int]) -> tuple[int, torch.Tensor | None]:
        """The draft's next token for seq and, when seq samples, the distribution q it was drawn from."""
        runner = self.runner
        request = runner.sample_request(seq, proposed)
        adjusted = runner.sampler.adjust(logits[None], [request])  # [1, vocab]
        if seq.sampling.greedy:
            return int(adjusted[0].argmax()), None
        q = runner.sampler.distribution(adjusted, [seq.sampling])[0]  # [vocab]
        return draw(q, request.generator), q

    def _forward(self, rows: list[tuple[Sequence, list[int], int]]) -> torch.Tensor:
        """Run the draft over each row's tokens (starting at the given position); logits of each row's last."""
        bs, dev = self.block_size, self.device
        input_ids, positions, slots, cu, lens, prompts, tables, last = [], [], [], [0], [], [], [], []
        for seq, ids, start in rows:
            table = seq.block_table
            input_ids += ids
            positions += range(start, start + len(ids))
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + len(ids))]
            cu.append(len(input_ids))
            lens.append(start + len(ids))
            prompts.append(seq.num_prompt_tokens)
            tables.append(table)
            last.append(len(input_ids) - 1)
        ctx = Context.build(positions=positions, slot_mapping=slots, block_tables=tables, context_lens=lens,
                            cu_seqlens_q=cu, prompt_lens=prompts, lora=None, device=dev)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.int64, device=dev), ctx)  # [T, hidden]
        return self.model.compute_logits(hidden[last])  # [B, vocab]
