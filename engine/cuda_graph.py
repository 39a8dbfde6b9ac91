"""Decode steps through static buffers, replayed as CUDA graphs, one per padded batch size (as vLLM, SGLang and
nano-vllm capture them).

Every per-step input lives in a buffer allocated once and refilled in place before each step: token ids,
positions, slot mapping, block tables, context lengths, prompt lengths, each token's adapter index, and the
adapters' page tables, ranks and scalings, laid out [layer, module, adapter, rank] so that every LoRA
projection's tables are views of them. A step of n sequences runs the graph of the smallest bucket >= n, its
rows past n padded (no KV slot, one visible key, no adapter): one graph replays any mix of adapters, lengths
and blocks. Inside the forward nothing is read back to the host and nothing branches on a tensor's values:
what needs the host is done before (`fill`), the kernels read the rest from the buffers.

`capture=False` (CPU, tests) runs the same static path eagerly: the replay contract, same storage refilled in
place giving the eager result, is checked there, on the references and on the Triton launchers (interpreted).
"""

import logging
from dataclasses import dataclass

import numpy as np
import torch

import kernels
from engine.context import Context
from engine.lora_batch import ModuleTables
from engine.lora_linear import LoRALinear
from engine.models import CausalLM
from engine.models.moe import Experts
from engine.step_inputs import StepInputs
from kernels.lora_meta import LoRAMeta

log = logging.getLogger(__name__)

PADDING = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "context_lens": 1, "prompt_lens": 1,
           "token_slots": -1}  # what a padded row holds: nothing stored, one visible key (page 0), no adapter


def batch_buckets(max_batch: int) -> list[int]:
    """The padded batch sizes that get a graph: 1, 2, 4, then every 8, and max_batch."""
    return sorted({b for b in (1, 2, 4) if b < max_batch} | set(range(8, max_batch, 8)) | {max_batch})


def graph_unsupported(model: CausalLM) -> str | None:
    """Why this model's decode cannot be captured, or None."""
    if model.comm.size > 1:
        return "tensor parallelism (the workers run their own eager forward)"
    if any(isinstance(m, Experts) for m in model.modules()):
        return "a mixture-of-experts model (its expert LoRA tables are still cut inside the forward)"
    return None


class StaticLoRA:
    """The step's adapters' page tables in buffers of max_slots adapters at max_rank: a_rows/b_rows [L, M, U, R]
    int64 (where each A row / row of B transposed starts in the layer's pages), ranks [L, M, U] int32, scaling
    [L, M, U] float32. Slots past the step's adapters have rank 0 (the kernels skip them). Every slice reads its
    own A rows (a fused-name adapter's slices point at the same ones: AdapterPlan), so no choice is made on
    the tables' values."""

    def __init__(self, *, keys: list[tuple[int, int, int]], num_layers: int, num_modules: int, max_slots: int,
                 max_rank: int, zero_row: int, device: torch.device) -> None:
        shape = (num_layers, num_modules, max_slots, max_rank)
        self.zero_row = zero_row
        self.a_rows = torch.full(shape, zero_row, dtype=torch.int64, device=device)
        self.b_rows = torch.full(shape, zero_row, dtype=torch.int64, device=device)
        self.ranks = torch.zeros(shape[:3], dtype=torch.int32, device=device)
        self.scaling = torch.zeros(shape[:3], dtype=torch.float32, device=device)
        self.key: tuple | None = None  # the adapters and placements the buffers hold
        self.modules = {key: self._module(*key) for key in keys}  # (layer, first, slices) -> views, made once

    @property
    def max_slots(self) -> int:
        return self.ranks.shape[2]

    def _module(self, layer: int, first: int, num_slices: int) -> ModuleTables:
        part = slice(first, first + num_slices)
        ranks = self.ranks[layer, part]  # [S, U], contiguous views, as every table below
        return ModuleTables(a_rows=self.a_rows[layer, part], a_ranks=ranks, b_rows=self.b_rows[layer, part],
                            ranks=ranks, scaling=self.scaling[layer, part])

    def fits(self, num_adapters: int) -> bool:
        return num_adapters <= self.max_slots

    def fill(self, key: tuple, tables) -> None:
        """Refill in place from AdapterPool.tables (offsets [U, L, M', 2, R], ranks [U, L, M] host, scaling
        [U, L, M]) unless they hold `key` already."""
        if key == self.key:
            return
        offsets, ranks, scaling = tables[0], tables[1], tables[2]
        modules = self.a_rows.shape[1]  # the model's LoRA projections come first (engine.lora_modules)
        used, width = offsets.shape[0], offsets.shape[-1]
        if used > self.max_slots or width > self.a_rows.shape[3]:
            raise ValueError(f"{used} adapters of rank {width} do not fit static tables {tuple(self.a_rows.shape)}")
        self.a_rows.fill_(self.zero_row)
        self.b_rows.fill_(self.zero_row)
        self.ranks.zero_()
        self.scaling.zero_()
        self.a_rows[:, :, :used, :width] = offsets[:, :, :modules, 0].permute(1, 2, 0, 3)
        self.b_rows[:, :, :used, :width] = offsets[:, :, :modules, 1].permute(1, 2, 0, 3)
        self.ranks[:, :, :used] = ranks[:, :, :modules].permute(1, 2, 0).to(self.ranks.device)
        self.scaling[:, :, :used] = scaling[:, :, :modules].permute(1, 2, 0).to(self.scaling.device)
        self.key = key


@dataclass
class StaticLoRABatch:
    """What a LoRALinear reads of the step's adapters (engine.lora_batch.LoRABatch's interface), over StaticLoRA's
    buffers: every module's tables are views made once."""

    token_slots: torch.Tensor  # [bucket] a view of DecodeGraphs' buffer
    meta: LoRAMeta | object  # the tokens' grouping (LoRAMeta, filled in the graph; the references' SlotBatch)
    modules: dict[tuple[int, int, int], ModuleTables]

    def module(self, layer: int, first: int, num_slices: int) -> ModuleTables:
        return self.modules[(layer, first, num_slices)]


class DecodeGraphs:
    """Static buffers for decode steps of up to max_batch sequences whose block tables hold up to max_blocks
    pages, and (capture=True, CUDA) one captured graph per (bucket, with adapters or not)."""

    def __init__(self, *, model: CausalLM, max_batch: int, max_blocks: int, max_rank: int, zero_row: int,
                 capture: bool, device: torch.device) -> None:
        self.model, self.capture, self.device = model, capture, device
        self.buckets = batch_buckets(max_batch)
        rows, self.max_blocks = self.buckets[-1], max_blocks
        sizes = {name: rows for name in PADDING} | {"cu_seqlens_q": rows + 1, "block_tables": rows * max_blocks}
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
        keys = sorted({(m.layer, m.first, m.num_slices) for m in model.modules() if isinstance(m, LoRALinear)})
        self.lora = None
        if keys:
            memory = next(m.memory for m in model.modules() if isinstance(m, LoRALinear))
            self.lora = StaticLoRA(keys=keys, num_layers=len(layers), num_modules=max(f + s for _, f, s in keys),
                                   max_slots=rows, max_rank=max_rank, zero_row=memory.zero_row, device=device)
        self.triton = kernels.backend_for(self.flat) == "triton"
        self.contexts: dict[tuple[int, bool], Context] = {}  # Triton path: one per key, its views fixed
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}  # each graph's hidden states [bucket, hidden]
        self.pool = None  # the graphs' shared memory pool
        self.copied = None  # CUDA event: the last staging -> device copy is done (the staging may be refilled)
        self.failure: str | None = None  # why capture failed: every later step runs eagerly
        self.steps = 0  # decode steps run through the buffers (replayed, with capture)

    def takes(self, inputs: StepInputs) -> bool:
        """Whether this step can run here: a decode step that fits the buffers (and no capture has failed)."""
        return (self.failure is None and inputs.is_decode and len(inputs.context_lens) <= self.buckets[-1]
                and max(len(t) for t in inputs.block_tables) <= self.max_blocks
                and (not inputs.adapters or (self.lora is not None and self.lora.fits(len(inputs.adapters)))))

    def run(self, inputs: StepInputs, lora_key: tuple | None = None, lora_tables=None) -> torch.Tensor | None:
        """Hidden states [n, hidden] of the step's n tokens; None when the graph could not be captured (then the
        caller runs the step eagerly, as every later one). lora_tables: AdapterPool.tables of inputs.adapters,
        lora_key what identifies them (asked for only when the buffers hold other ones)."""
        n = len(inputs.context_lens)
        bucket = next(b for b in self.buckets if b >= n)
        use_lora = bool(inputs.adapters)
        self.fill(inputs, bucket)
        if use_lora:
            self.lora.fill(lora_key, lora_tables() if callable(lora_tables) else lora_tables)
        key = (bucket, use_lora)
        self.steps += 1
        if not self.capture:
            return self._forward(key, self.context(key))[:n]
        if key not in self.graphs and not self._capture(key):
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
        host["token_slots"][:n] = inputs.token_slots
        tables = host["block_tables"]
        tables[:bucket] = 0
        for row, table in enumerate(inputs.block_tables):
            tables[row, : len(table)] = table
        self.flat.copy_(self.staging, non_blocking=True)
        if self.device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record()

    def context(self, key: tuple[int, bool]) -> Context:
        """The Context over the buffers' first `bucket` rows. The Triton path's is made once per key (its LoRA
        grouping refilled by the forward itself); the references' is cut again each step, before the forward
        (their decode buckets and adapter grouping are host-side by design)."""
        if key in self.contexts:
            return self.contexts[key]
        bucket, use_lora = key
        b = self.buffers
        lora = None
        if use_lora:
            slots = b["token_slots"][:bucket]
            num_slots = self.lora.max_slots
            meta = LoRAMeta.empty(bucket, num_slots, self.device) if self.triton else kernels.lora_meta(slots, num_slots)
            lora = StaticLoRABatch(token_slots=slots, meta=meta, modules=self.lora.modules)
        ctx = Context(positions=b["positions"][:bucket], slot_mapping=b["slot_mapping"][:bucket],
                      block_tables=b["block_tables"][:bucket], context_lens=b["context_lens"][:bucket],
                      cu_seqlens_q=b["cu_seqlens_q"][: bucket + 1], prompt_lens=b["prompt_lens"][:bucket],
                      is_decode=True, lora=lora).prepare_decode(self.k_cache, self.windows)
        if self.triton:
            self.contexts[key] = ctx
        return ctx

    def _forward(self, key: tuple[int, bool], ctx: Context) -> torch.Tensor:
        """What a graph holds: the LoRA grouping of the tokens (device ops) and the model's forward."""
        if ctx.lora is not None and isinstance(ctx.lora.meta, LoRAMeta):
            ctx.lora.meta.fill_(ctx.lora.token_slots)
        return self.model(self.buffers["input_ids"][: key[0]], ctx)  # [bucket, hidden]

    def _capture(self, key: tuple[int, bool]) -> bool:
        ctx = self.context(key)
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
        self.graphs[key], self.outputs[key] = graph, out
        log.info("captured the decode CUDA graph for batch %d%s", key[0], " with adapters" if key[1] else "")
        return True
