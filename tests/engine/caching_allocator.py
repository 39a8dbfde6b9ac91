"""What a CUDA run would hold, told on CPU: the allocations of a CPU run replayed through a model of CUDA's
caching allocator.

torch's CUDA allocator (c10/cuda/CUDACachingAllocator.cpp, default settings) rounds a request to 512 bytes, takes
the smallest cached free block that fits (splitting off the rest: small pool when the rest is 512 bytes or more,
large pool when it is over 1 MiB), and otherwise asks the driver for a segment: 2 MiB for requests up to 1 MiB,
20 MiB up to 10 MiB, else the request rounded up to 2 MiB. A freed block merges with its free neighbours and stays
cached; torch.cuda.empty_cache() hands back only segments wholly free. So a tensor that is kept, made while a
large freed block is cached, is cut from that block and keeps its whole segment from the driver.

The CPU runs the same Python code, so its allocations (torch.profiler with profile_memory: address and size of
each, in order) are the ones a CUDA run makes on the device, except inside ranges the caller marks as host work
(reading a checkpoint: on CUDA those tensors are on the host and only copied into device tensors already made);
a marked release is where the code calls torch.cuda.empty_cache()."""

import bisect
import json
from contextlib import contextmanager
from functools import wraps

import torch

MIB = 1 << 20
_SMALL, _SMALL_SEGMENT, _LARGE_SEGMENT, _MIN_LARGE, _ROUND_LARGE = MIB, 2 * MIB, 20 * MIB, 10 * MIB, 2 * MIB
HOST, RELEASE = "caching_allocator.host", "caching_allocator.release"


class _Block:
    def __init__(self, segment: int, offset: int, size: int) -> None:
        self.segment, self.offset, self.size = segment, offset, size
        self.free, self.prev, self.next = True, None, None


class CachingAllocator:
    def __init__(self) -> None:
        self._free = {True: [], False: []}  # small pool? -> sorted [((size, segment, offset), block)]
        self._segments: dict[int, int] = {}  # segment id -> bytes held from the driver
        self._live: dict[int, tuple[bool, _Block]] = {}  # handle (the CPU address) -> (small pool?, block)
        self._made = 0  # segments asked for so far (each one's id)

    def _insert(self, small: bool, block: _Block) -> None:
        bisect.insort(self._free[small], ((block.size, block.segment, block.offset), block), key=lambda e: e[0])

    def _remove(self, small: bool, block: _Block) -> None:
        self._free[small].remove(((block.size, block.segment, block.offset), block))

    def malloc(self, handle: int, size: int) -> None:
        if handle in self._live:  # the CPU reused an address whose free came unreported: it was freed
            self.free(handle)
        size = max(512, -(-size // 512) * 512)
        small = size <= _SMALL
        pool = self._free[small]
        found = bisect.bisect_left(pool, (size, -1, -1), key=lambda e: e[0])
        if found < len(pool):
            block = pool[found][1]
            self._remove(small, block)
        else:
            held = (_SMALL_SEGMENT if small else _LARGE_SEGMENT if size < _MIN_LARGE
                    else -(-size // _ROUND_LARGE) * _ROUND_LARGE)
            self._made += 1
            block = _Block(self._made, 0, held)
            self._segments[block.segment] = held
        rest = block.size - size
        if rest >= 512 if small else rest > _SMALL:
            tail = _Block(block.segment, block.offset + size, rest)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._insert(small, tail)
        block.free = False
        self._live[handle] = (small, block)

    def free(self, handle: int) -> None:
        small, block = self._live.pop(handle)
        block.free = True
        if block.prev is not None and block.prev.free:
            prev = block.prev
            self._remove(small, prev)
            prev.size += block.size
            prev.next = block.next
            if block.next is not None:
                block.next.prev = prev
            block = prev
        if block.next is not None and block.next.free:
            after = block.next
            self._remove(small, after)
            block.size += after.size
            block.next = after.next
            if after.next is not None:
                after.next.prev = block
        self._insert(small, block)

    def empty_cache(self) -> None:
        for pool in self._free.values():
            for entry in [e for e in pool if e[1].prev is None and e[1].next is None]:
                pool.remove(entry)
                del self._segments[entry[1].segment]

    def live(self) -> set[int]:
        return set(self._live)

    def reserved(self) -> int:
        """Bytes held from the driver: what torch.cuda.mem_get_info counts as used."""
        return sum(self._segments.values())


@contextmanager
def marked(monkeypatch, owner, name: str, label: str):
    """Run owner.name (a function or method) inside a profiler range named `label` while the block runs."""
    original = getattr(owner, name)

    @wraps(original)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(label):
            return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    yield


def replay(run, trace_path) -> CachingAllocator:
    """Run `run()` on CPU under the profiler and replay its allocations: those inside HOST ranges are left out
    (their frees of device blocks are not), a RELEASE range empties the cache where it starts. run() returns the
    tensors still held at the end; any other block whose free the profiler did not report is freed at the end.
    Returns the allocator after a last torch.cuda.empty_cache()."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = {t.untyped_storage().data_ptr() for t in run()}
    prof.export_chrome_trace(str(trace_path))
    events = json.loads(trace_path.read_text())["traceEvents"]
    host = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == HOST and e.get("ph") == "X"]
    steps = [(e["ts"], 0, 0, None) for e in events if e.get("name") == RELEASE and e.get("ph") == "X"]
    steps += [(e["ts"], 1, e["args"]["Ev Idx"], e["args"]) for e in events if e.get("name") == "[memory]"]
    allocator = CachingAllocator()
    for ts, _, _, args in sorted(steps, key=lambda step: step[:3]):
        if args is None:
            allocator.empty_cache()
        elif args["Bytes"] < 0:
            if args["Addr"] in allocator.live():
                allocator.free(args["Addr"])
        elif not any(start <= ts <= end for start, end in host):
            allocator.malloc(args["Addr"], args["Bytes"])
    for handle in allocator.live() - kept:
        allocator.free(handle)
    allocator.empty_cache()
    return allocator
