"""Copying an adapter's rows from its host layout (AdapterPlan) into the device pages it was given, off the step loop.

The one seam between the adapter pool and the device's copy engine. `start` returns at once with a `Copy`, which
has one event per layer. A copier whose `streams_layers` is true lets the adapter's sequences into a step while the
copy is under way: the step's forward waits for each layer's event before that layer reads the adapter's rows
(`Copy.wait_layer`, through LoRABatch.wait_layer), so a prefill starts on the layers already copied. Otherwise the
pool admits them only once `Copy.done()`, and the events they wait for are already set.

- CPU (`streams_layers` false): the copy is synchronous (`index_copy_` per layer), run on the copier's own thread
  while the engine thread runs steps over other pages of the same tensors. Waiting for a layer would block the
  engine thread, and every other request's step with it: the adapter's sequences wait for the whole copy instead.
- CUDA (`streams_layers` true): the host layout is pinned (AdapterPlan.build(pin=True)); each layer is copied
  non-blocking on a side stream, with an event recorded after it. Waiting for layer `i` is the engine stream's
  `wait_event` on it: no host wait, the GPU orders the prefill's layer `i` after that layer's copy. The side stream
  first waits for the work the engine's stream had queued when the copy started: the pages may have been read by a
  step still running (an evicted adapter, freed KV).
"""

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from engine.adapter_plan import AdapterPlan
from engine.paged_memory import PagedMemory

Offsets = tuple[torch.Tensor, ...]  # the adapter's page tables on the device (AdapterPlan.page_offsets)


class Copy(Protocol):
    def done(self) -> bool:
        """Whether every layer is in its pages (never blocks)."""

    def result(self) -> Offsets:
        """The page tables on the device, once done (blocks until then; raises what the copy raised)."""

    def seconds(self) -> float:
        """How long the copy took, once done (on CUDA, as the side stream ran it)."""

    def tables(self) -> Offsets:
        """The page tables on the device, for work queued from now on the caller's stream (never blocks)."""

    def wait_layer(self, layer: int) -> None:
        """Make what runs next wait until layer `layer` (and every layer before it) is in its pages."""


def write_layer(memory: PagedMemory, plan: AdapterPlan, layer: int, ids: torch.Tensor) -> None:
    """The adapter's chunks of one layer into their pages (`ids`: the chunk rows, AdapterPlan.chunk_ids)."""
    target = memory.layers[layer].view(-1, memory.chunk)  # [2 * (num_pages + 1), chunk]
    target.index_copy_(0, ids, plan.chunks[layer].to(device=target.device, dtype=target.dtype, non_blocking=True))


class _ThreadCopy:
    def __init__(self, offsets: Offsets, num_layers: int) -> None:
        self.offsets = offsets
        self.layers = [threading.Event() for _ in range(num_layers)]  # set as each layer is in its pages
        self.future: Future | None = None

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> Offsets:
        self.future.result()
        return self.offsets

    def seconds(self) -> float:
        return self.future.result()

    def tables(self) -> Offsets:
        return self.offsets

    def wait_layer(self, layer: int) -> None:
        self.layers[layer].wait()


class CpuCopier:
    """Copies synchronously, one adapter at a time, on its own thread."""

    streams_layers = False  # a wait would block the engine thread: sequences wait for the whole copy

    def __init__(self, memory: PagedMemory) -> None:
        self.memory = memory
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-copier")

    def start(self, plan: AdapterPlan, pages: list[int], offsets: Offsets) -> Copy:
        copy = _ThreadCopy(offsets, plan.chunks.shape[0])
        copy.future = self._executor.submit(self._copy, plan, pages, copy)
        return copy

    def _copy(self, plan: AdapterPlan, pages: list[int], copy: _ThreadCopy) -> float:
        started = time.perf_counter()
        mem = self.memory
        try:
            ids = plan.chunk_ids(pages, chunk=mem.chunk, chunk_start=mem.chunk_start)
            for layer, copied in enumerate(copy.layers):
                write_layer(mem, plan, layer, ids)
                copied.set()
        finally:  # a failed copy wakes its waiters too; `result()` raises what it raised
            for copied in copy.layers:
                copied.set()
        return time.perf_counter() - started

    def close(self) -> None:
        """Finish the copies started, then stop the thread."""
        self._executor.shutdown(wait=True)


class _StreamCopy:
    def __init__(self, start: torch.cuda.Event, tables: torch.cuda.Event, layers: list[torch.cuda.Event],
                 offsets: Offsets) -> None:
        self._start, self._tables, self.layers, self._offsets = start, tables, layers, offsets

    def done(self) -> bool:
        return self.layers[-1].query()

    def result(self) -> Offsets:
        self.layers[-1].synchronize()
        return self._offsets

    def seconds(self) -> float:
        return self._start.elapsed_time(self.layers[-1]) / 1000.0

    def tables(self) -> Offsets:
        """The current stream waits for the tables' copy (no host wait)."""
        torch.cuda.current_stream().wait_event(self._tables)
        return self._offsets

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait for layer `layer` (no host wait)."""
        torch.cuda.current_stream().wait_event(self.layers[layer])


class CudaCopier:
    """Pinned host -> device copies, per layer, on a side stream; enqueueing them never waits for the GPU."""

    streams_layers = True  # a step waits per layer on the GPU, never on the host

    def __init__(self, memory: PagedMemory) -> None:
        self.memory = memory
        self.stream = torch.cuda.Stream(memory.layers[0].device)

    def start(self, plan: AdapterPlan, pages: list[int], offsets: Offsets) -> Copy:
        mem, device = self.memory, self.memory.layers[0].device
        self.stream.wait_stream(torch.cuda.current_stream())
        layers = []
        with torch.cuda.stream(self.stream):
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            ids = plan.chunk_ids(pages, chunk=mem.chunk, chunk_start=mem.chunk_start).to(device, non_blocking=True)
            tables = tuple(table.to(device, non_blocking=True) for table in offsets)
            tables_copied = torch.cuda.Event()
            tables_copied.record(self.stream)
            for layer in range(plan.chunks.shape[0]):
                write_layer(mem, plan, layer, ids)
                event = torch.cuda.Event(enable_timing=True)
                event.record(self.stream)
                layers.append(event)
        return _StreamCopy(start, tables_copied, layers, tables)

    def close(self) -> None:
        self.stream.synchronize()


def page_copier(memory: PagedMemory) -> CpuCopier | CudaCopier:
    """The copier for the device the pages live on."""
    return CudaCopier(memory) if memory.layers[0].device.type == "cuda" else CpuCopier(memory)
