"""A step's adapters as the LoRA kernels see them, in buffers allocated once and refilled in place.

How to use it (engine.model_runner does this):

    lora = LoRABatch(num_layers=L, device=device, zero_row=memory.zero_row, num_experts=E)   # once per engine
    lora.reserve(max_tokens=T, max_adapters=U, max_rank=R)   # optional: size it up front (before a CUDA graph)
    lora.fill(token_adapters, pool.slot_tables(digests))    # every step, before the forward, outside it
    lora.wait_for(pool.copies_under_way(digests))           # a step whose adapters are still being copied
    ctx.lora = lora                                         # the same object every step

`token_adapters[t]` is the index of token t's adapter in the step's `digests` (-1: the base model). `fill` gives
each adapter a slot it keeps while it stays in the same pages (AdapterTables.key), copies the page tables, ranks and
scalings only into slots whose adapter changed, and writes the tokens' slots and their grouping (kernels.LoRAMeta)
in place. Capacity grows (by powers of two, keeping every slot's contents) only when a step needs more tokens,
adapters or rank than reserved; after `reserve`, a step within it never moves a buffer.

On the Triton path (CUDA, or CPU under kernels.interpreter) the forward reads only views made once of these
buffers (`module`, `experts`): no host sync, no allocation and no Python branch on tensor contents, so one CUDA
graph captured over a step replays any other mix of adapters once `fill` has run. Every projection launches its
kernel whether or not an adapter of the step adapts it (the kernel's programs exit at once).

On the reference path (CPU), `module` and `experts` cut tables narrowed to the step's slots and largest rank
(None when no adapter of the step adapts the module), once per change of slots: the references gather dense
operands per table and keep them in the step's SlotBatch, which a later step keeps while no slot changed.

An adapter whose copy into its pages is under way (a copier that streams layers, engine/page_copier.py) can be in a
step: `wait_for` hands its copies to the batch, and each LoRA layer calls `wait_layer(layer)` before it reads the
adapters' rows, so layer i waits for layer i's copy alone. Steps with no copy under way (all but an adapter's
first) wait for nothing; a step with one runs eagerly, never as a CUDA graph (engine.model_runner).
"""

from collections import OrderedDict
from dataclasses import dataclass

import torch

import kernels
from engine.lora_modules import EXPERT_INDEX, MODULES
from kernels.slot_batch import SlotBatch


@dataclass(frozen=True)
class AdapterTables:
    """One resident adapter's tables, as AdapterPool.slot_tables hands them out."""

    key: int  # the placement: the same key, the same page tables
    offsets: torch.Tensor  # [L, M', 2, r] int64 (device): where each A / B-transposed row starts
    expert_offsets: torch.Tensor  # [L, 2, 2, rows] int64 (device): the experts' modules' (AdapterPlan)
    ranks: torch.Tensor  # [L, M] int32 (device)
    scaling: torch.Tensor  # [L, M] float32 (device)
    host_ranks: torch.Tensor  # [L, M] int32 (host)
    a_source: torch.Tensor  # [L, M] int64 (host): the module whose A rows each module reads (AdapterPlan)


@dataclass
class ModuleTables:
    a_rows: torch.Tensor  # [S_a, U, R] int64: where each A row starts in the layer's page memory; S_a is 1 when
    # every slice of every adapter reads the same A (fused-name adapters, reference path only), else S
    a_ranks: torch.Tensor  # [S_a, U] int32: the ranks of those A rows
    b_rows: torch.Tensor  # [S, U, R] int64: where each row of B transposed starts
    ranks: torch.Tensor  # [S, U] int32, each slice's own rank
    scaling: torch.Tensor  # [S, U] float32


@dataclass
class ExpertTables:
    """Page tables of one expert module (lora_modules.EXPERT_INDEX) of a layer, per adapter and expert."""

    a_rows: torch.Tensor  # [U, E, R] int64: where each expert's A rows start in the layer's page memory
    b_rows: torch.Tensor  # [S, U, E, R] int64: where its rows of B transposed start, per output slice
    ranks: torch.Tensor  # [U] int32: each adapter's rank per expert (0: the adapter leaves the module alone)
    scaling: torch.Tensor  # [U] float32


def _grown(needed: int, have: int, least: int) -> int:
    """A capacity for `needed`: `have` when it fits (and is at least `least`), else the next power of two."""
    needed = max(needed, least)
    return have if needed <= have else 1 << (needed - 1).bit_length()


class LoRABatch:
    def __init__(self, *, num_layers: int, device: torch.device, zero_row: int, num_experts: int = 0) -> None:
        self.device = device
        self.zero_row = zero_row  # where the tables of absent rows point (the zero page)
        self.num_experts = num_experts
        self.max_tokens = self.max_adapters = self.max_rank = 0
        self.shape = (num_layers, EXPERT_INDEX[0], len(MODULES))  # (L, M', M): AdapterPlan's tables
        self.offsets: torch.Tensor | None = None  # and the other tables: _allocate
        self.generation = 0  # bumped whenever a slot's contents change
        self.writes: list[tuple[int, AdapterTables]] = []  # what the last fill wrote, by slot (tensor parallel)
        self.step_slots: list[int] = []  # the last fill's token -> slot
        self.token_slots: torch.Tensor | None = None  # [T] int32: the step's, a view of the buffer
        self.copies: list = []  # the step's adapters' copies into pages still under way (page_copier.Copy)
        self._waited = -1  # the last layer this step waited for
        self.meta: kernels.LoRAMeta | SlotBatch | None = None
        self._keys: list[int | None] = []  # the key of the adapter in each slot
        self._slot_of: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # slots, least recently used first
        self._views: dict[tuple, ModuleTables | ExpertTables] = {}  # Triton path: views, made once per buffer
        self._cuts: dict[tuple, ModuleTables | ExpertTables | None] = {}  # reference path: per generation
        self._cut_width = -1  # slots the reference cuts cover
        self._triton = False
        self.reserve()

    def reserve(self, *, max_tokens: int = 0, max_adapters: int = 0, max_rank: int = 0) -> None:
        """Make room for steps of up to these sizes (at least 16 tokens, 8 adapters, rank 16)."""
        tokens = _grown(max_tokens, self.max_tokens, 16)
        adapters = _grown(max_adapters, self.max_adapters, 8)
        rank = _grown(max_rank, self.max_rank, 16)
        if tokens != self.max_tokens or adapters != self.max_adapters:
            self._meta = kernels.LoRAMeta.empty(tokens, adapters, self.device)
            self._staging = None  # a pinned copy of the meta's buffer, what fill_host_ copies from on CUDA
            if self.device.type == "cuda":
                self._staging = torch.empty(self._meta.packed.shape, dtype=torch.int32).pin_memory()
                self._copied = torch.cuda.Event()
                self._copied.record()
        self.max_tokens = tokens
        if (adapters, rank) != (self.max_adapters, self.max_rank):
            self._allocate(adapters, rank)
        self.max_adapters, self.max_rank = adapters, rank
        self._keys += [None] * (adapters - len(self._keys))
        for slot in reversed(range(len(self._lru), adapters)):
            self._lru[slot] = None
            self._lru.move_to_end(slot, last=False)  # new slots are taken first

    def _allocate(self, adapters: int, rank: int) -> None:
        """(Re)allocate the tables at these capacities, keeping what the slots hold."""
        layers, dense, modules = self.shape
        dev, old = self.device, self.offsets
        offsets = torch.full((layers, dense, 2, adapters, rank), self.zero_row, dtype=torch.int64, device=dev)
        ranks = torch.zeros(layers, modules, adapters, dtype=torch.int32, device=dev)  # [L, M, U]
        scaling = torch.zeros(layers, modules, adapters, dtype=torch.float32, device=dev)  # [L, M, U]
        host_ranks = torch.zeros(layers, modules, adapters, dtype=torch.int32)  # [L, M, U]
        a_source = torch.arange(modules).view(1, modules, 1).repeat(layers, 1, adapters)  # [L, M, U]
        experts = self.num_experts
        expert_a = torch.full((layers, 2, adapters, experts, rank), self.zero_row, dtype=torch.int64, device=dev)
        expert_b = torch.full((layers, 2, 2, adapters, experts, rank), self.zero_row, dtype=torch.int64, device=dev)
        if old is not None:  # grown: the slots keep their contents
            u, r = self.max_adapters, self.max_rank
            offsets[..., :u, :r] = self.offsets
            ranks[..., :u], scaling[..., :u] = self.ranks, self.scaling
            host_ranks[..., :u], a_source[..., :u] = self.host_ranks, self.a_source
            if self.expert_a.numel():
                expert_a[:, :, :u, :, :r], expert_b[:, :, :, :u, :, :r] = self.expert_a, self.expert_b
        self.offsets = offsets  # [L, M', 2 (A, B^T), U, R] int64
        self.ranks, self.scaling, self.host_ranks, self.a_source = ranks, scaling, host_ranks, a_source
        self.expert_a = expert_a  # [L, 2 (modules), U, E, R] int64: each expert's A rows
        self.expert_b = expert_b  # [L, 2 (modules), 2 (slices), U, E, R] int64: its B-transposed rows per slice
        self._views.clear()
        self._bump()

    # every step

    def fill(self, token_adapters: list[int], adapters: list[AdapterTables]) -> "LoRABatch":
        """The step's tokens and adapters (see the module docstring); returns self."""
        self.reserve(max_tokens=len(token_adapters), max_adapters=len(adapters),
                     max_rank=max((t.offsets.shape[-1] for t in adapters), default=0))
        self.writes = []
        slots = []
        for tables in adapters:
            slot = self._slot_of.get(tables.key)
            if slot is None:
                slot = next(iter(self._lru))  # every slot this step uses moved to the end: this one is free
                if self._keys[slot] is not None:
                    del self._slot_of[self._keys[slot]]
                self._write(slot, tables)
            self._lru.move_to_end(slot)
            slots.append(slot)
        self._fill_tokens([slots[i] if i >= 0 else -1 for i in token_adapters])
        return self

    def wait_for(self, copies: list) -> "LoRABatch":
        """The copies (page_copier.Copy) still under way of this step's adapters: each layer waits for its own."""
        self.copies, self._waited = copies, -1
        return self

    def wait_layer(self, layer: int) -> None:
        """Before `layer` reads the adapters' rows: wait for that layer of each copy under way (a copy's layers
        finish in order, so one wait per layer covers the layers before it). Nothing on a step without one."""
        if self.copies and layer > self._waited:
            for copy in self.copies:
                copy.wait_layer(layer)
            self._waited = layer

    def fill_slots(self, token_slots: list[int], writes: list[tuple[int, AdapterTables]]) -> "LoRABatch":
        """What another rank's `fill` did (its `step_slots` and `writes`), done here: tensor-parallel workers."""
        self.reserve(max_tokens=len(token_slots), max_adapters=max([s + 1 for s, _ in writes] + [0]),
                     max_rank=max([t.offsets.shape[-1] for _, t in writes] + [0]))
        self.writes = []
        for slot, tables in writes:
            self._write(slot, tables)
        self._fill_tokens(token_slots)
        return self

    def _write(self, slot: int, tables: AdapterTables) -> None:
        rank = tables.offsets.shape[-1]
        self.offsets[..., slot, rank:].fill_(self.zero_row)
        self.offsets[..., slot, :rank].copy_(tables.offsets)
        self.ranks[..., slot].copy_(tables.ranks)
        self.scaling[..., slot].copy_(tables.scaling)
        self.host_ranks[..., slot] = tables.host_ranks
        self.a_source[..., slot] = tables.a_source
        if self.expert_a.numel():
            self._write_experts(slot, tables)
        self._keys[slot] = tables.key
        self._slot_of[tables.key] = slot
        self.writes.append((slot, tables))
        self._bump()

    def _write_experts(self, slot: int, tables: AdapterTables) -> None:
        """The slot's expert tables: expert e's A rows e*r .. e*r + r - 1 of its page table, and of slice s of B
        s*E*r + e*r + j (AdapterPlan), r the module's rank in each layer."""
        table = tables.expert_offsets  # [L, 2, 2, rows]
        rows = table.shape[-1]
        if rows == 0:
            self.expert_a[:, :, slot].fill_(self.zero_row)
            self.expert_b[:, :, :, slot].fill_(self.zero_row)
            return
        layers, experts, width = table.shape[0], self.num_experts, self.max_rank
        rank = tables.ranks[:, EXPERT_INDEX[0] : EXPERT_INDEX[1] + 1].long()[:, :, None, None, None]  # [L, 2, 1, 1, 1]
        s = torch.arange(2, device=self.device)[:, None, None]
        e = torch.arange(experts, device=self.device)[None, :, None]
        index = ((s * experts + e) * rank + torch.arange(width, device=self.device)).clamp_(max=rows - 1)
        a = table[:, :, 0].gather(2, index[:, :, 0].reshape(layers, 2, -1))  # [L, 2, E * R]
        b = table[:, :, 1].gather(2, index.reshape(layers, 2, -1))  # [L, 2, 2 * E * R]
        self.expert_a[:, :, slot] = a.view(layers, 2, experts, width)
        self.expert_b[:, :, :, slot] = b.view(layers, 2, 2, experts, width)

    def _fill_tokens(self, token_slots: list[int]) -> None:
        self.step_slots = token_slots
        self.copies = []  # until `wait_for` says otherwise
        self._triton = kernels.backend_for(self._meta.packed) == "triton"
        if self._triton:  # grouped on the host, one copy into the meta's buffer
            if self._staging is not None:
                self._copied.synchronize()  # the last step's copy from the staging buffer is done
            self.meta = self._meta.fill_host_(token_slots, staging=self._staging)
            if self._staging is not None:
                self._copied.record()
            self.token_slots = self._meta.token_slots[: len(token_slots)]  # [T]
            return
        self.token_slots = torch.tensor(token_slots, dtype=torch.int32, device=self.device)  # [T]
        previous = self.meta if isinstance(self.meta, SlotBatch) and not self.writes else None
        self.meta = SlotBatch.build(self.token_slots, previous=previous)
        width = max(token_slots, default=-1) + 1
        if self.writes or width > self._cut_width:
            self._cuts.clear()
            self._cut_width = max(width, 1) if self.writes else max(width, self._cut_width)

    def _bump(self) -> None:
        self.generation += 1
        self._cuts.clear()

    # in the forward

    def module(self, layer: int, first: int, num_slices: int) -> ModuleTables | None:
        """Tables of module indices first .. first + num_slices - 1 of a layer. On the Triton path views of the
        buffers (never None); on the reference path cut for the step's slots, None when no adapter of the step
        targets any of them."""
        key = (layer, first, num_slices)
        if self._triton:
            tables = self._views.get(key)
            if tables is None:
                rows = self.offsets[layer, first : first + num_slices]  # [S, 2, U, R]
                ranks = self.ranks[layer, first : first + num_slices]  # [S, U]
                tables = self._views[key] = ModuleTables(
                    a_rows=rows[:, 0], a_ranks=ranks, b_rows=rows[:, 1], ranks=ranks,
                    scaling=self.scaling[layer, first : first + num_slices])
            return tables
        if key not in self._cuts:
            self._cuts[key] = self._cut(layer, first, num_slices)
        return self._cuts[key]

    def _cut(self, layer: int, first: int, num_slices: int) -> ModuleTables | None:
        used = self._cut_width
        host = self.host_ranks[layer, first : first + num_slices, :used]  # [S, U]
        width = int(host.max()) if host.numel() else 0
        if width == 0:
            return None
        rows = self.offsets[layer, first : first + num_slices, :, :used, :width]  # [S, 2, U, R]
        ranks = self.ranks[layer, first : first + num_slices, :used].contiguous()  # [S, U]
        a_slices = 1 if self._one_a(layer, first, num_slices, used) else num_slices
        return ModuleTables(a_rows=rows[:a_slices, 0].contiguous(), a_ranks=ranks[:a_slices].contiguous(),
                            b_rows=rows[:, 1].contiguous(), ranks=ranks,
                            scaling=self.scaling[layer, first : first + num_slices, :used].contiguous())

    def experts(self, layer: int, module: int, num_experts: int, num_slices: int) -> ExpertTables | None:
        """Tables of expert module `module` of a layer (Triton path: views; reference path: None when no adapter of
        the step adapts it)."""
        key = (layer, module, -num_experts)
        which = module - EXPERT_INDEX[0]
        if self._triton:
            tables = self._views.get(key)
            if tables is None:
                tables = self._views[key] = ExpertTables(
                    a_rows=self.expert_a[layer, which], b_rows=self.expert_b[layer, which, :num_slices],
                    ranks=self.ranks[layer, module], scaling=self.scaling[layer, module])
            return tables
        if key not in self._cuts:
            used = self._cut_width
            width = int(self.host_ranks[layer, module, :used].max())
            self._cuts[key] = None if width == 0 else ExpertTables(
                a_rows=self.expert_a[layer, which, :used, :, :width].contiguous(),
                b_rows=self.expert_b[layer, which, :num_slices, :used, :, :width].contiguous(),
                ranks=self.ranks[layer, module, :used].contiguous(),
                scaling=self.scaling[layer, module, :used].contiguous())
        return self._cuts[key]

    def _one_a(self, layer: int, first: int, num_slices: int, used: int) -> bool:
        """Whether every adapter of the step that adapts a later slice reads the first slice's A there (the
        slices of a fused-name adapter, engine.lora_modules.per_slice): then one shrink serves every slice."""
        later = slice(first + 1, first + num_slices)
        reads_first = self.a_source[layer, later, :used] == first  # [S - 1, U]
        return bool((reads_first | (self.host_ranks[layer, later, :used] == 0)).all())
