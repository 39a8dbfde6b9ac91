"""Runs one scheduled step: flattens it into a ragged token batch, runs the model, samples."""

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.adapter_pool import AdapterPool
from engine.context import Context, ImageBatch
from engine.cuda_graph import DecodeGraphs, graph_unsupported
from engine.guided import GuidedDecoding
from engine.lora_batch import LoRABatch
from engine.lora_linear import LoRALinear
from engine.models import CausalLM
from engine.paged_memory import PagedMemory
from engine.sampler import Sample, Sampler, SampleRequest
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.speculative.rejection import accept_greedy, verify_sampled
from engine.step_inputs import StepInputs

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    samples: list[Sample] = field(default_factory=list)  # empty: mid-prompt; several: speculative tokens verified
    num_proposed: int = 0  # speculative tokens verified this step (len(samples) - 1 of them were accepted)
    prompt_logprobs: list[tuple[int, float, dict[int, float]]] = field(default_factory=list)  # (pos, lp, top)


class ModelRunner:
    def __init__(
        self,
        *,
        model: CausalLM,
        memory: PagedMemory,
        adapters: AdapterPool,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        guided: GuidedDecoding | None = None,
        cuda_graphs: bool = False,
        max_batch: int = 1,
        max_model_len: int = 0,
        max_adapter_rank: int = 0,
        max_tokens: int = 0,
    ) -> None:
        """cuda_graphs (CUDA only): decode steps of up to max_batch sequences of up to max_model_len tokens, with
        adapters of up to max_adapter_rank, replay CUDA graphs (engine/cuda_graph.py); max_tokens: the most
        tokens of a step."""
        self.model = model
        self.guided = guided or GuidedDecoding(vocab_size=model.spec.vocab_size, device=device)
        self.adapters = adapters
        self.eos_token_ids = eos_token_ids
        self.memory = memory
        self.block_size = memory.kv_shape[1]
        self.device = device
        self.sampler = Sampler()
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> its own RNG (seeded requests)
        # (seq_id, image offset) -> the encoder's output for an image whose prefill goes on in a later chunk
        self.encoded: dict[tuple[int, int], list[torch.Tensor]] = {}
        moe = getattr(model.spec, "moe", None)
        self.lora = LoRABatch(num_layers=model.spec.num_layers, device=device, zero_row=memory.zero_row,
                              num_experts=moe.num_experts if moe else 0)  # the eager steps' adapters, refilled
        self.k_cache = model.model.layers[0].self_attn.k_cache  # every layer's has this shape
        self.windows = {layer.self_attn.window for layer in model.model.layers}
        self.lora_modules = sorted({(m.layer, m.first, m.num_slices) for m in model.modules()
                                    if isinstance(m, LoRALinear)})
        self.graphs = None
        if cuda_graphs:
            self.graphs = self.static_decode(max_batch=max_batch, max_model_len=max_model_len,
                                             max_adapter_rank=max_adapter_rank, capture=True, max_tokens=max_tokens)

    def static_decode(self, *, max_batch: int, max_model_len: int, max_adapter_rank: int, capture: bool,
                      max_tokens: int = 0) -> DecodeGraphs | None:
        """Decode steps through static buffers from now on, captured as CUDA graphs (capture=True), or run
        eagerly through the same buffers (capture=False: CPU tests of the replay contract); None, said once in
        the log, when the model cannot. max_tokens: the most tokens an eager step has (the LoRA buffers are
        sized for it now, so that no later step moves them)."""
        reason = graph_unsupported(self.model)
        if reason is not None:
            log.info("decode runs eagerly: CUDA graphs do not support %s", reason)
            return None
        max_blocks = -(-max_model_len // self.block_size) + 1  # + 1: speculative lookahead past the last token
        graphs = DecodeGraphs(model=self.model, max_batch=max_batch, max_blocks=max_blocks, capture=capture,
                              device=self.device)
        # the LoRA buffers at their largest before any capture: a graph holds their addresses
        self.lora.reserve(max_tokens=max(max_tokens, graphs.buckets[-1]), max_adapters=graphs.buckets[-1],
                          max_rank=max_adapter_rank)
        log.info("decode steps of up to %d sequences run through static buffers%s (batch buckets %s)", max_batch,
                 ", captured as CUDA graphs" if capture else "", graphs.buckets)
        return graphs

    def release(self, seq: Sequence) -> None:
        self.generators.pop(seq.seq_id, None)
        for image in seq.images:
            self.encoded.pop((seq.seq_id, image.offset), None)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.sampling.seed is None or seq.sampling.greedy:
            return None
        if seq.seq_id not in self.generators:
            g = torch.Generator(device=self.device)
            g.manual_seed(seq.sampling.seed + seq.index)
            self.generators[seq.seq_id] = g
        return self.generators[seq.seq_id]

    def _flatten(self, out: SchedulerOutput, proposals: dict[int, list[int]]):
        """The step as one ragged batch of host lists, and which rows get logits. A sequence with proposed tokens
        runs them after its last token (verification rows)."""
        bs = self.block_size
        input_ids, positions, slot_mapping, token_slots = [], [], [], []
        # the step's adapters in one order while they stay (the gathered page tables are kept), and its sequences
        # adapter by adapter, base model last: each adapter's tokens are one run of rows
        adapter_slots = {digest: i for i, digest in enumerate(sorted({s.adapter for s in out.seqs} - {None}))}
        seqs = sorted(out.seqs, key=lambda s: len(adapter_slots) if s.adapter is None else adapter_slots[s.adapter])
        cu_seqlens, context_lens, prompt_lens, tables = [0], [], [], []
        mrope = [[], [], []] if self.model.spec.mrope_section else None
        images = []  # (key, features, rows, the image's token of each row, whether its last chunk) of the step's
        bidirectional = self.model.spec.bidirectional_images
        limits = [] if bidirectional else None  # [T]: the last position each row sees
        sample_rows: list[tuple[Sequence, int]] = []  # (seq, row of its last token and of each proposed one)
        prompt_rows: list[tuple[Sequence, int, int]] = []  # (seq, row, position whose next token is scored)
        for seq in seqs:
            proposal = proposals.get(seq.seq_id, [])
            n = out.num_tokens[seq.seq_id] + len(proposal)
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            row0 = len(input_ids)
            input_ids += seq.token_ids[start:] + proposal if proposal else seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.block_table
            slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, end)]
            slot = -1 if seq.adapter is None else adapter_slots[seq.adapter]
            token_slots += [slot] * n
            cu_seqlens.append(len(input_ids))
            context_lens.append(end)
            prompt_lens.append(seq.num_prompt_tokens)
            tables.append(table)
            if limits is not None:
                limits += range(start, end)
            if mrope is not None:
                for axis, values in zip(mrope, seq.mrope_positions(start, end), strict=True):
                    axis += values
            for image in seq.images:  # the image's tokens among this chunk's
                first, last = max(start, image.offset), min(end, image.offset + image.features.num_tokens)
                if first < last:
                    images.append(((seq.seq_id, image.offset), image.features,
                                   [row0 + p - start for p in range(first, last)],
                                   [p - image.offset for p in range(first, last)],
                                   last == image.offset + image.features.num_tokens))
                    if bidirectional:  # the scheduler keeps an image's tokens in one chunk (Sequence.unsplit)
                        assert last == image.offset + image.features.num_tokens, "a chunk ends inside an image"
                        limits[row0 + first - start : row0 + last - start] = [last - 1] * (last - first)
            if seq.sampling.prompt_logprobs is not None:
                prompt_rows += [(seq, row0 + p - start, p) for p in range(start, min(end, seq.num_prompt_tokens - 1))]
            if proposal:
                sample_rows += [(seq, len(input_ids) - 1 - i) for i in range(len(proposal), -1, -1)]
            elif end == seq.num_tokens:
                sample_rows.append((seq, len(input_ids) - 1))
        inputs = StepInputs(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, block_tables=tables,
                            context_lens=context_lens, cu_seqlens_q=cu_seqlens, prompt_lens=prompt_lens,
                            token_slots=token_slots, adapters=list(adapter_slots), mrope_positions=mrope,
                            images=images, key_limits=limits if images else None)
        return inputs, sample_rows, prompt_rows

    def eager_inputs(self, inputs: StepInputs, copies: list | None = None) -> tuple[torch.Tensor, Context]:
        """The step's token ids [T] and Context as fresh tensors, with everything the forward reads prepared
        before it: the decode attention's layout and every LoRA projection's tables. copies: the step's adapters'
        copies into pages still under way (AdapterPool.copies_under_way), which each layer waits for."""
        lora = None
        if inputs.adapters:  # the step's adapters into the LoRA buffers, refilled in place (engine.lora_batch)
            lora = self.lora.fill(inputs.token_slots, self.adapters.slot_tables(inputs.adapters))
            lora.wait_for(copies or [])
        ctx = Context.build(
            positions=inputs.positions, slot_mapping=inputs.slot_mapping, block_tables=inputs.block_tables,
            context_lens=inputs.context_lens, cu_seqlens_q=inputs.cu_seqlens_q, prompt_lens=inputs.prompt_lens,
            lora=lora, device=self.device, images=self.image_batch(inputs.images),
            mrope_positions=inputs.mrope_positions, key_limits=inputs.key_limits,
        ).prepare_decode(self.k_cache, self.windows)
        for key in self.lora_modules if lora is not None else ():
            lora.module(*key)  # cut now, not inside the forward
        return torch.tensor(inputs.input_ids, dtype=torch.int64, device=self.device), ctx

    def image_batch(self, images: list) -> ImageBatch | None:
        """The embeddings of the step's image tokens and their rows. The images not encoded yet are encoded in one
        call; one whose tokens go on in a later chunk is kept for it (self.encoded) until its last chunk."""
        if not images:
            return None
        missing = [(key, features) for key, features, _, _, _ in images if key not in self.encoded]
        if missing:
            pixels = torch.from_numpy(np.concatenate([features.pixels for _, features in missing])).to(self.device)
            encoded, deepstack = self.model.encode_images(pixels, [features.grid_thw for _, features in missing])
            sizes = [features.num_tokens for _, features in missing]
            parts = [encoded.split(sizes), *(layer.split(sizes) for layer in deepstack)]
            for i, (key, _) in enumerate(missing):
                self.encoded[key] = [part[i] for part in parts]  # [tokens, hidden]: the image, then deepstack's
        rows, chosen = [], []
        for key, _, image_rows, tokens, last_chunk in images:
            index = torch.tensor(tokens, device=self.device)
            chosen.append([part[index] for part in self.encoded[key]])
            rows += image_rows
            if last_chunk:
                del self.encoded[key]
        embeds, *deepstack = (torch.cat(layer) for layer in zip(*chosen, strict=True))
        return ImageBatch(rows=torch.tensor(rows, dtype=torch.int64, device=self.device), embeds=embeds,
                          deepstack=deepstack)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states [T, hidden] of the step: a decode step that fits replays its CUDA graph (or, without
        capture, runs through the same static buffers); any other runs eagerly, as does a step with an adapter
        whose copy into pages is under way (its layers wait for their copies: no graph holds such a wait)."""
        copies = self.adapters.copies_under_way(inputs.adapters) if inputs.adapters else []
        if self.graphs is not None and not copies and self.graphs.takes(inputs):
            lora = None
            if inputs.adapters:  # the bucket's padded rows use no adapter
                padded = inputs.token_slots + [-1] * (self.graphs.bucket(len(inputs.token_slots)) - len(inputs.token_slots))
                lora = self.lora.fill(padded, self.adapters.slot_tables(inputs.adapters))
            hidden = self.graphs.run(inputs, lora)
            if hidden is not None:
                return hidden
        return self.model(*self.eager_inputs(inputs, copies))

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, proposals: dict[int, list[int]] | None = None,
            draft_probs: dict[int, torch.Tensor] | None = None) -> dict[int, StepResult]:
        """proposals: seq_id -> speculative tokens to verify; draft_probs: seq_id -> [k, vocab], what they were
        drawn from (absent: deterministic proposals)."""
        proposals = proposals or {}
        inputs, sample_rows, prompt_rows = self._flatten(out, proposals)
        # constrained sequences never speculate (engine/speculative/policy.py): one sample row each
        constrained = [seq for seq, _ in sample_rows if self.guided.constrained(seq)]
        pending = self.guided.start(constrained)  # masks computed while the model runs
        hidden = self.forward(inputs)  # [T, hidden]
        rows = [row for _, row in sample_rows] + [row for _, row, _ in prompt_rows]
        logits = self.model.compute_logits(hidden[rows]) if rows else None  # [N, vocab] float32
        results = {seq.seq_id: StepResult() for seq in out.seqs}
        allowed = self.guided.allowed(pending, constrained) if pending is not None else {}
        if sample_rows:
            self._sample(logits[: len(sample_rows)], sample_rows, proposals, draft_probs or {}, results, allowed)
        if prompt_rows:
            self._score_prompts(logits[len(sample_rows) :], prompt_rows, results)
        return results

    def _sample(self, logits: torch.Tensor, sample_rows, proposals, draft_probs, results, allowed) -> None:
        plain = [i for i, (seq, _) in enumerate(sample_rows) if not proposals.get(seq.seq_id)]
        if plain:
            seqs = [sample_rows[i][0] for i in plain]
            samples = self.sampler(logits[plain], [self.sample_request(seq, allowed=allowed.get(seq.seq_id))
                                                   for seq in seqs])
            for seq, sample in zip(seqs, samples, strict=True):
                results[seq.seq_id].samples = [sample]
        spec = []  # (seq, first row, its requests) of the sequences whose proposals are verified
        row = 0
        for seq in dict.fromkeys(seq for seq, _ in sample_rows):  # batch order, each once
            proposal = proposals.get(seq.seq_id, [])
            if proposal:
                spec.append((seq, row, [self.sample_request(seq, proposal[:i]) for i in range(len(proposal) + 1)]))
            row += len(proposal) + 1
        if not spec:
            return
        rows = [r for _, first, requests in spec for r in range(first, first + len(requests))]
        adjusted = self.sampler.adjust(logits[rows], [r for _, _, requests in spec for r in requests])  # [R, vocab]
        targets = adjusted.argmax(dim=-1).tolist()  # one sync for every greedy row of the step
        at = 0
        for seq, first, requests in spec:
            proposal, n = proposals[seq.seq_id], len(requests)
            if seq.sampling.greedy:
                tokens = accept_greedy(proposal, targets[at : at + n])
            else:
                tokens = verify_sampled(self.sampler, adjusted[at : at + n], requests, proposal,
                                        draft_probs.get(seq.seq_id))
            own = logits[first : first + len(tokens)]  # [emitted, vocab]
            results[seq.seq_id].samples = self.sampler.samples(own, requests[: len(tokens)], tokens)
            results[seq.seq_id].num_proposed = len(proposal)
            at += n

    def _score_prompts(self, logits: torch.Tensor, prompt_rows, results: dict[int, StepResult]) -> None:
        logprobs = torch.log_softmax(logits, dim=-1)  # [P, vocab]
        targets = torch.tensor([seq.token_ids[pos + 1] for seq, _, pos in prompt_rows], device=logits.device)
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()  # [P]
        k = max(seq.sampling.prompt_logprobs for seq, _, _ in prompt_rows)
        top_values, top_ids = (logprobs.topk(k) if k else (logprobs[:, :0], logprobs[:, :0].long()))
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        for i, (seq, _, pos) in enumerate(prompt_rows):
            n = seq.sampling.prompt_logprobs
            top = dict(zip(top_ids[i][:n], top_values[i][:n], strict=True))
            results[seq.seq_id].prompt_logprobs.append((pos + 1, chosen[i], top))

    def sample_request(self, seq: Sequence, proposed: list[int] = (), *,
                       allowed: torch.Tensor | None = None) -> SampleRequest:
        """What the sampler needs for seq's next token, after `proposed` tokens (speculative) if any; `allowed`:
        what its grammar allows ([vocab] bool)."""
        s = seq.sampling
        banned = []
        if seq.num_completion_tokens + len(proposed) < s.min_tokens:
            banned = list(s.stop_token_ids) + ([] if s.ignore_eos else list(self.eos_token_ids))
        output = seq.completion_token_ids + list(proposed) if proposed else seq.completion_token_ids
        prompt = seq.prompt_token_ids if s.repetition_penalty != 1.0 else []
        return SampleRequest(sampling=s, output_token_ids=output, generator=self._generator(seq), banned_token_ids=banned,
                             allowed=allowed, prompt_token_ids=prompt)
