"""Decode steps through static buffers, replayed as CUDA graphs, one per padded batch size (as vLLM, SGLang and
nano-vllm capture them).

Every per-step input lives in a buffer allocated once and refilled in place before each step: token ids,
positions, slot mapping, block tables, context lengths and prompt lengths here; each token's adapter slot, its
grouping by adapter and the adapters' page tables, ranks and scalings in the runner's LoRABatch
(engine/lora_batch.py), whose module tables are views made once. A multimodal rope's (Qwen-VL's) positions have a buffer
too: in decode a token's three positions are one, its index plus its sequence's offset (Sequence.mrope_positions),
so one row is filled and read as three (a step whose rows differ runs eagerly). A step of n sequences runs the
graph of the smallest bucket >= n, its rows past n padded (no KV slot, one visible key, no adapter): one graph replays any
mix of adapters, lengths and blocks. Inside the forward nothing is read back to the host and nothing branches
on a tensor's values: what needs the host is done before (`fill`, LoRABatch.fill), the kernels read the rest
from the buffers. A graph also holds the LoRABatch's buffers' addresses: should they move (a step needed more
tokens, adapters or rank than reserved), the graphs with adapters are captured again.

`capture=False` (CPU, tests) runs the same static path eagerly: the replay contract, same storage refilled in
place giving the eager result, is checked there, on the references and on the Triton launchers (interpreted).
"""

import logging

import numpy as np
import torch

import kernels
from engine.context import Context
from engine.lora_batch import LoRABatch
from engine.models import CausalLM
from engine.models.moe import Experts
from engine.step_inputs import StepInputs

log = logging.getLogger(__name__)

PADDING = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "context_lens": 1, "prompt_lens": 1}  # a padded
# row: nothing stored, one visible key (page 0); its adapter slot is -1 (ModelRunner pads the token slots)


def batch_buckets(max_batch: int) -> list[int]:
    """The padded batch sizes that get a graph: 1, 2, 4, then every 8, and max_batch."""
    return sorted({b for b in (1, 2, 4) if b < max_batch} | set(range(8, max_batch, 8)) | {max_batch})


def graph_unsupported(model: CausalLM) -> str | None:
    """Why this model's decode cannot be captured, or None."""
    if model.comm.size > 1:
        return "tensor parallelism (the workers run their own eager forward)"
    if any(isinstance(m, Experts) for m in model.modules()):
        return "a mixture-of-experts model (not yet checked for host reads in its routing)"
    return None


def lora_storage(lora: LoRABatch | None) -> tuple[int, ...]:
    """The addresses a graph captured of a LoRABatch's buffers (equal while none was reallocated)."""
    if lora is None:
        return ()
    return (lora.meta.packed.data_ptr(), lora.offsets.data_ptr(), lora.ranks.data_ptr(), lora.scaling.data_ptr())


class DecodeGraphs:
    """Static buffers for decode steps of up to max_batch sequences whose block tables hold up to max_blocks
    pages, and (capture=True, CUDA) one captured graph per (bucket, with adapters or not)."""

    def __init__(self, *, model: CausalLM, max_batch: int, max_blocks: int, capture: bool,
                 device: torch.device) -> None:
        self.model, self.capture, self.device = model, capture, device
        self.buckets = batch_buckets(max_batch)
        rows, self.max_blocks = self.buckets[-1], max_blocks
        self.mrope = bool(model.spec.mrope_section)
        sizes = {name: rows for name in PADDING} | {"cu_seqlens_q": rows + 1, "block_tables": rows * max_blocks}
        if self.mrope:
            sizes["mrope_positions"] = rows  # the (t, h, w) positions, equal in decode: one row read as three
        # one int64 buffer for every field (a single host -> device copy per step), and its host twin
        self.flat = torch.zeros(sum(sizes.values()), dtype=torch.int64, device=device)
        self.staging = torch.zeros_like(self.flat, device="cpu", pin_memory=device.type == "cuda")
        host = self.staging.numpy()
        self.buffers: dict[str, torch.Tensor] = {}
        self.host: dict[str, np.ndarray] = {}
        at = 0
        for name, size in sizes.items():
            self.buffers[name], self.host[name] = self.flat[at : at + size], host[at : at + size]
            at += size
        self.buffers["block_tables"] = self.buffers["block_tables"].view(rows, max_blocks)  # [N, W]
        self.host["block_tables"] = self.host["block_tables"].reshape(rows, max_blocks)
        self.host["cu_seqlens_q"][:] = np.arange(rows + 1)  # one token per sequence: the same every step
        layers = model.model.layers
        self.k_cache = layers[0].self_attn.k_cache
        self.windows = {layer.self_attn.window for layer in layers}
        self.triton = kernels.backend_for(self.flat) == "triton"
        self.contexts: dict[tuple[int, bool], Context] = {}  # Triton path: one per key, its views fixed
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.storage: dict[tuple[int, bool], tuple[int, ...]] = {}  # the LoRABatch addresses each graph holds
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}  # each graph's hidden states [bucket, hidden]
        self.pool = None  # the graphs' shared memory pool
        self.copied = None  # CUDA event: the last staging -> device copy is done (the staging may be refilled)
        self.failure: str | None = None  # why capture failed: every later step runs eagerly
        self.steps = 0  # decode steps run through the buffers (replayed, with capture)

    def takes(self, inputs: StepInputs) -> bool:
        """Whether this step can run here: a decode step that fits the buffers (and no capture has failed)."""
        return (self.failure is None and inputs.is_decode and len(inputs.context_lens) <= self.buckets[-1]
                and max(len(t) for t in inputs.block_tables) <= self.max_blocks
                and (inputs.mrope_positions is None or inputs.mrope_positions[0] == inputs.mrope_positions[1]
                     == inputs.mrope_positions[2]))

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def run(self, inputs: StepInputs, lora: LoRABatch | None) -> torch.Tensor | None:
        """Hidden states [n, hidden] of the step's n tokens; None when the graph could not be captured (then the
        caller runs the step eagerly, as every later one). lora: the step's adapters, filled for the bucket's rows
        (the padded ones at -1), or None."""
        n = len(inputs.context_lens)
        key = (self.bucket(n), lora is not None)
        self.fill(inputs, key[0])
        self.steps += 1
        if not self.capture:
            return self._forward(key, self.context(key, lora))[:n]
        if key in self.graphs and self.storage[key] != lora_storage(lora):
            log.info("the LoRA buffers moved: capturing the decode graph for batch %d again", key[0])
            del self.graphs[key], self.outputs[key]
        if key not in self.graphs and not self._capture(key, lora):
            return None
        self.graphs[key].replay()
        return self.outputs[key][:n]

    def fill(self, inputs: StepInputs, bucket: int) -> None:
        """Write the step into the staging buffer, rows past its sequences padded, and copy it to the device
        buffers in one copy (in place: the graphs' addresses stay)."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has read the staging
        n, host = len(inputs.context_lens), self.host
        for name, pad in PADDING.items():
            host[name][n:bucket] = pad
        host["input_ids"][:n] = inputs.input_ids
        host["positions"][:n] = inputs.positions
        host["slot_mapping"][:n] = inputs.slot_mapping
        host["context_lens"][:n] = inputs.context_lens
        host["prompt_lens"][:n] = inputs.prompt_lens
        if self.mrope:
            host["mrope_positions"][:n] = inputs.mrope_positions[0]
            host["mrope_positions"][n:bucket] = 0
        tables = host["block_tables"]
        tables[:bucket] = 0
        for row, table in enumerate(inputs.block_tables):
            tables[row, : len(table)] = table
        self.flat.copy_(self.staging, non_blocking=True)
        if self.device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record()

    def context(self, key: tuple[int, bool], lora: LoRABatch | None) -> Context:
        """The Context over the buffers' first `bucket` rows (and the LoRABatch, whose views the LoRA projections
        read). The Triton path's is made once per key; the references' is cut again each step, before the
        forward (their decode buckets are host-side by design)."""
        if key in self.contexts:
            return self.contexts[key]
        bucket, b = key[0], self.buffers
        ctx = Context(positions=b["positions"][:bucket], slot_mapping=b["slot_mapping"][:bucket],
                      block_tables=b["block_tables"][:bucket], context_lens=b["context_lens"][:bucket],
                      cu_seqlens_q=b["cu_seqlens_q"][: bucket + 1], prompt_lens=b["prompt_lens"][:bucket],
                      is_decode=True, lora=lora,
                      mrope_positions=b["mrope_positions"][:bucket].expand(3, -1) if self.mrope else None,
                      ).prepare_decode(self.k_cache, self.windows)
        if self.triton:
            self.contexts[key] = ctx
        return ctx

    def _forward(self, key: tuple[int, bool], ctx: Context) -> torch.Tensor:
        return self.model(self.buffers["input_ids"][: key[0]], ctx)  # [bucket, hidden]

    def _capture(self, key: tuple[int, bool], lora: LoRABatch | None) -> bool:
        self.contexts.pop(key, None)
        ctx = self.context(key, lora)
        try:
            self._forward(key, ctx)  # warm-up: compiles the kernels (and runs this step, replayed below)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._forward(key, ctx)
        except (RuntimeError, ValueError, TypeError) as exc:  # torch and Triton raise these on an uncapturable op
            self.failure = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graph capture failed for decode batch %d%s (%s); decode steps run eagerly from now on",
                        key[0], " with adapters" if key[1] else "", self.failure)
            return False
        self.pool = graph.pool()
        self.graphs[key], self.outputs[key], self.storage[key] = graph, out, lora_storage(lora)
        log.info("captured the decode CUDA graph for batch %d%s", key[0], " with adapters" if key[1] else "")
        return True
