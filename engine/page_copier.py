"""Copying an adapter's rows from its host layout (AdapterPlan) into the device pages it was given, off the step loop.

The one seam between the adapter pool and the device's copy engine. `start` returns at once with a `Copy`; the
pool places the adapter's sequences in a step only once `Copy.done()`, so no step waits for a copy.

- CPU: the copy is synchronous (`index_copy_` per layer), run on the copier's own thread while the engine thread
  runs steps over other pages of the same tensors.
- CUDA: the host layout is pinned (AdapterPlan.build(pin=True)); each layer is copied non-blocking on a side
  stream, with an event recorded after it, so a consumer could wait for layer `i` alone (`Copy.wait_layer`) and
  start on the layers already copied. The side stream first waits for the work the engine's stream had queued
  when the copy started: the pages may have been read by a step still running (an evicted adapter, freed KV).
"""

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


def write_layer(memory: PagedMemory, plan: AdapterPlan, layer: int, ids: torch.Tensor) -> None:
    """The adapter's chunks of one layer into their pages (`ids`: the chunk rows, AdapterPlan.chunk_ids)."""
    target = memory.layers[layer].view(-1, memory.chunk)  # [2 * (num_pages + 1), chunk]
    target.index_copy_(0, ids, plan.chunks[layer].to(device=target.device, dtype=target.dtype, non_blocking=True))


class _ThreadCopy:
    def __init__(self, future: Future) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> Offsets:
        return self._future.result()[0]

    def seconds(self) -> float:
        return self._future.result()[1]


class CpuCopier:
    """Copies synchronously, one adapter at a time, on its own thread."""

    def __init__(self, memory: PagedMemory) -> None:
        self.memory = memory
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-copier")

    def start(self, plan: AdapterPlan, pages: list[int], offsets: Offsets) -> Copy:
        return _ThreadCopy(self._executor.submit(self._copy, plan, pages, offsets))

    def _copy(self, plan: AdapterPlan, pages: list[int], offsets: Offsets) -> tuple[Offsets, float]:
        started = time.perf_counter()
        mem = self.memory
        ids = plan.chunk_ids(pages, chunk=mem.chunk, chunk_start=mem.chunk_start)
        for layer in range(plan.chunks.shape[0]):
            write_layer(mem, plan, layer, ids)
        return offsets, time.perf_counter() - started

    def close(self) -> None:
        """Finish the copies started, then stop the thread."""
        self._executor.shutdown(wait=True)


class _StreamCopy:
    def __init__(self, start: torch.cuda.Event, layers: list[torch.cuda.Event], offsets: Offsets) -> None:
        self._start, self.layers, self._offsets = start, layers, offsets

    def done(self) -> bool:
        return self.layers[-1].query()

    def result(self) -> Offsets:
        self.layers[-1].synchronize()
        return self._offsets

    def seconds(self) -> float:
        return self._start.elapsed_time(self.layers[-1]) / 1000.0

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait for layer `layer` alone (no host wait)."""
        torch.cuda.current_stream().wait_event(self.layers[layer])


class CudaCopier:
    """Pinned host -> device copies, per layer, on a side stream; enqueueing them never waits for the GPU."""

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
            for layer in range(plan.chunks.shape[0]):
                write_layer(mem, plan, layer, ids)
                event = torch.cuda.Event(enable_timing=True)
                event.record(self.stream)
                layers.append(event)
        return _StreamCopy(start, layers, tables)

    def close(self) -> None:
        self.stream.synchronize()


def page_copier(memory: PagedMemory) -> CpuCopier | CudaCopier:
    """The copier for the device the pages live on."""
    return CudaCopier(memory) if memory.layers[0].device.type == "cuda" else CpuCopier(memory)
