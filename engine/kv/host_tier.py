"""The host tier: prefix blocks evicted from the device page pool, kept in host memory, loaded back on a hit.

A bounded store of block slots in host memory (pinned on CUDA), least-recently-used first, filled as the
block manager evicts cached blocks (`save`, before the page is reused) and read when a waiting sequence's
next keys are here (`lookup`, `start_load`). A load writes into pages the scheduler took for it and no
sequence reads yet, off the step's critical path: on CUDA on a side stream (after the current stream's
work, including the saves of the pages it overwrites), on CPU in a thread; `finished_loads` polls. A slot
a load reads from is not reused until the load is done. fp8 pages are kept as fp8 with their scales.

Both sides of engine/kv/connector.py in one object: the engine is one process (no tensor parallelism here).
"""

import logging
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.kv.connector import Load
from engine.kv.payload import KVLayout, read_pages, write_pages
from engine.paged_memory import PagedMemory

log = logging.getLogger(__name__)


def block_bytes(layout: KVLayout) -> int:
    """Host bytes of one block: its K and V of every layer, and their scales."""
    return layout.num_layers * 2 * (layout.half_bytes + 4 * layout.scale_values)


class HostTier:
    def __init__(self, *, memory: PagedMemory, capacity_bytes: int) -> None:
        self.memory = memory
        self.layout = lay = KVLayout.of(memory)
        self.capacity_blocks = capacity_bytes // block_bytes(lay)
        if self.capacity_blocks < 1:
            raise ValueError(f"a KV host cache of {capacity_bytes} bytes holds no block of {block_bytes(lay)} bytes")
        self.device = memory.layers[0].device
        cuda = self.device.type == "cuda"
        n = self.capacity_blocks
        self.kv = torch.empty(n, lay.num_layers, 2, lay.half_bytes, dtype=torch.uint8, pin_memory=cuda)
        self.scales = (torch.empty(n, lay.num_layers, 2, lay.scale_values, dtype=torch.float32, pin_memory=cuda)
                       if lay.scales else None)
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # key -> slot; least recently used first
        self.free_slots = list(range(n - 1, -1, -1))
        self.reading: Counter[int] = Counter()  # slot -> loads reading it
        self._saved_at: dict[int, torch.cuda.Event] = {}  # CUDA: slot -> when its last save is in host memory
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._thread = None if cuda else ThreadPoolExecutor(1, thread_name_prefix="kv-host-load")
        self._in_flight: list[tuple[Load, list[int], Future | torch.cuda.Event]] = []
        self.num_saved = 0  # blocks copied in
        self.num_not_saved = 0  # evictions it had no free slot for (every slot being read)
        self.num_loaded = 0  # blocks loaded back into pages

    @property
    def num_blocks(self) -> int:
        return len(self.slots)

    @property
    def loads_in_flight(self) -> int:
        return len(self._in_flight)

    # scheduler side
    def lookup(self, keys: list[bytes]) -> int:
        count = 0
        for key in keys:
            if key not in self.slots:
                break
            count += 1
        return count

    def save(self, block_id: int, key: bytes) -> None:
        if key in self.slots:  # still here from an earlier eviction (loaded back since): bytes are the same
            self.slots.move_to_end(key)
            return
        slot = self._take_slot()
        if slot is None:
            self.num_not_saved += 1
            return
        cuda = self._stream is not None
        for layer, pages in enumerate(self.memory.layers):  # on the current stream: before any later write
            self.kv[slot, layer].copy_(pages.view(torch.uint8)[:, block_id], non_blocking=cuda)
            if self.scales is not None:
                self.scales[slot, layer].copy_(self.memory.scales[layer][:, block_id], non_blocking=cuda)
        if cuda:
            event = torch.cuda.Event()
            event.record()
            self._saved_at[slot] = event
        self.slots[key] = slot
        self.num_saved += 1

    def _take_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for key, slot in self.slots.items():  # least recently used that no load reads
            if not self.reading[slot]:
                del self.slots[key]
                self._saved_at.pop(slot, None)
                return slot
        return None

    def start_load(self, load: Load) -> None:
        slots = [self.slots[key] for key in load.keys]
        for key in load.keys:
            self.slots.move_to_end(key)
        self.reading.update(slots)
        if self._stream is None:
            self._in_flight.append((load, slots, self._thread.submit(self._copy_in, load.block_ids, slots)))
            return
        self._stream.wait_stream(torch.cuda.current_stream())  # the pages' last reads and saves come first
        for slot in slots:
            if slot in self._saved_at:
                self._stream.wait_event(self._saved_at[slot])
        with torch.cuda.stream(self._stream):
            self._copy_in(load.block_ids, slots)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._in_flight.append((load, slots, done))

    def _copy_in(self, block_ids: list[int], slots: list[int]) -> None:
        if self._stream is None:  # CPU: gather the slots, then write the pages
            index = torch.tensor(slots, dtype=torch.int64)
            scales = None if self.scales is None else self.scales.index_select(0, index)
            write_pages(self.memory, block_ids, self.kv.index_select(0, index), scales)
            return
        # CUDA, on the side stream: each slot straight from pinned memory, ordered after its save (wait_event)
        kv = torch.empty((len(slots), *self.kv.shape[1:]), dtype=torch.uint8, device=self.device)
        scales = None
        if self.scales is not None:
            scales = torch.empty((len(slots), *self.scales.shape[1:]), dtype=torch.float32, device=self.device)
        for i, slot in enumerate(slots):
            kv[i].copy_(self.kv[slot], non_blocking=True)
            if scales is not None:
                scales[i].copy_(self.scales[slot], non_blocking=True)
        write_pages(self.memory, block_ids, kv, scales)

    def finished_loads(self) -> list[Load]:
        done, still = [], []
        for load, slots, pending in self._in_flight:
            if not (pending.done() if isinstance(pending, Future) else pending.query()):
                still.append((load, slots, pending))
                continue
            if isinstance(pending, Future) and pending.exception() is not None:
                log.error("kv host tier: a load failed; the sequence recomputes", exc_info=pending.exception())
                load.ok = False
                for key in load.keys:  # their bytes are suspect: gone from the tier
                    slot = self.slots.pop(key, None)
                    if slot is not None:
                        self._saved_at.pop(slot, None)
                        self.free_slots.append(slot)
            else:
                self.num_loaded += len(load.keys)
            self.reading.subtract(slots)
            done.append(load)
        self._in_flight = still
        return done

    # worker side
    def read(self, block_ids: list[int]):
        return read_pages(self.memory, block_ids)

    def write(self, block_ids: list[int], data) -> None:
        write_pages(self.memory, block_ids, *data)

    def state(self) -> dict:
        return {"blocks": self.num_blocks, "capacity_blocks": self.capacity_blocks,
                "capacity_bytes": self.capacity_blocks * block_bytes(self.layout), "saved": self.num_saved,
                "not_saved": self.num_not_saved, "loaded": self.num_loaded, "loads_in_flight": self.loads_in_flight}

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
