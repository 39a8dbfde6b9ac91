"""Adapters in three tiers: device pages (shared with the KV cache), a host cache bounded in bytes, disk.

Disk -> host: a background thread reads, checks and lays out (AdapterPlan) an adapter when its first request
arrives (`ready`); tensors are pinned when the device is CUDA. Host -> device pages: `place` takes the pages and
hands the copy to a PageCopier (engine/page_copier.py: its own thread on CPU, a side stream on CUDA); the adapter
is resident, and its sequences can be admitted, once the copy is done, or at once where the copier streams layers
(CUDA, one rank): then a step that uses it while its copy is under way waits per layer on the device
(`copies_under_way`, LoRABatch.wait_layer), and it is not evicted before the copy is done. Neither move runs on the step loop, so
sequences of resident adapters keep stepping while another adapter loads. A resident adapter is in use while a
running sequence uses it (`acquire`/`release`); idle ones are evicted least-recently-used when pages run short
(`reclaim`), never those the caller says it keeps (the scheduler keeps what waiting sequences need).

An adapter can be pinned always-warm in one tier (`pin`/`unpin`): a host pin is never evicted from the host tier, a
device pin never from its pages, until it is unpinned. Pins are counted in the tier's budget (host: their bytes
within `host_cache_bytes`; device: their pages within `pin_pages`, the pages the pool was given for adapters), and
a pin past it is refused (`PinRefused`), never taken from what unpinned adapters and the KV cache share. Every failure of a load is contained: `take_failures()` reports it once, by
digest, with a reason that names no server path, and the next request for that adapter reads it again; nothing
that failed its checks is kept in any tier. Nothing outside this class touches its fields.

Tensor-parallel workers keep no tier of their own on disk: a `Mirror` (engine/workers/worker_group.py) is
handed what they need of an adapter from the one read rank 0 made, when it enters the host tier, and is told
when it leaves that tier and when it is placed in pages, so every rank uses the same bytes.
"""

import queue
import re
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

import adapters
from adapters.file_reads import DEFAULT, ReadPolicy
from engine.adapter_plan import AdapterPlan
from engine.lora_batch import AdapterTables
from engine.lora_modules import per_slice
from engine.page_copier import Copy, page_copier
from engine.paged_memory import PagedMemory

CANONICAL_SIDECAR = "quilt_adapter.json"
LOAD_MEAN_WEIGHT = 0.1  # each move's share of the running mean of its kind's load seconds (state()["load_seconds"])
_PATH = re.compile(r"(?<![\w.])(?:[A-Za-z]:)?[/\\][^\s'\"(),;]*")


def read_adapter(path: str | Path, base_config: dict, max_rank: int, *, digest: str | None = None,
                 policy: ReadPolicy = DEFAULT) -> "adapters.LoadedAdapter":
    """The disk tier: Quilt's canonical folder on the fast path, anything PEFT wrote otherwise; fused-name
    modules (Phi-3's qkv_proj, gate_up_proj) come back as their slices (lora_modules.per_slice). `digest`: the
    one the adapter was made known by, which a canonical folder's sidecar must name (its tensors are then not
    hashed again, adapters.load_canonical); a PEFT folder is converted, and so hashed, whatever is known. `policy`:
    how a canonical folder's weights are read (paced, around the page cache: adapters.file_reads)."""
    path = Path(path)
    if (path / CANONICAL_SIDECAR).exists():
        adapter = adapters.load_canonical(path, digest=digest, policy=policy)
    else:
        adapter = adapters.load_adapter(path, base_config, max_rank=max_rank)
    return per_slice(adapter, adapters.BaseShapes.from_config(base_config))


def failure_reason(error: BaseException) -> str:
    """Why a load failed, for the tenant: the error's own words with any filesystem path cut out."""
    if isinstance(error, adapters.AdapterError):
        text = f"{error} ({error.code})"
    elif isinstance(error, FileNotFoundError):
        text = "its files are missing"
    elif isinstance(error, OSError):
        text = f"its files could not be read ({error.strerror or type(error).__name__})"
    else:
        text = f"the loader failed ({type(error).__name__})"
    return _PATH.sub("<adapter>", text)


class Mirror(Protocol):
    """Other ranks that hold copies of this pool's host tier and placements (tensor-parallel workers)."""

    def pack(self, adapter: "adapters.LoadedAdapter") -> object:
        """What the other ranks need of an adapter, from rank 0's one read of it (any thread)."""

    def hold(self, digest: str, packed: object) -> None:
        """The adapter entered the host tier."""

    def drop(self, digest: str) -> None:
        """It left the host tier."""

    def place(self, digest: str, pages: list[int]) -> None:
        """It was placed in `pages` (from the host tier)."""


class PinRefused(Exception):
    """A pin the tier cannot take: over its budget, or of an adapter not in that tier."""


class Residency(NamedTuple):
    """One adapter in one memory tier."""

    digest: str
    tier: str  # "device" or "host"
    pinned: bool  # pinned always-warm in this tier (`AdapterPool.pin`): never evicted from it
    rank: int  # its largest module rank


class LoadTime(NamedTuple):
    """One move of an adapter between tiers that succeeded, and how long it took."""

    from_tier: str  # "disk" or "host"
    to_tier: str  # "host" or "device"
    seconds: float  # disk -> host: read, checked and laid out; host -> device: the copy into pages (on CUDA, timed
    # on the side stream that runs it)


class Placing(NamedTuple):
    """An adapter whose pages are taken and whose copy into them is under way."""

    plan: AdapterPlan
    pages: list[int]
    copy: Copy


class Prepared(NamedTuple):
    """An adapter read and laid out, ready for the host tier (see `prepare`)."""

    plan: AdapterPlan
    packed: object  # the mirror's part, None without one


@dataclass
class Resident:
    plan: AdapterPlan
    pages: list[int]
    offsets: tuple[torch.Tensor, torch.Tensor]  # on the device: the adapter's page tables, [L, M', 2, max_rank] and
    # [L, 2, 2, expert_rows] (AdapterPlan.page_offsets)
    placement: int  # unique per placement: the same number means the same page table
    users: int = 0  # running sequences that use it
    tables: AdapterTables | None = None  # what LoRABatch.fill reads, made on first use


class AdapterPool:
    def __init__(
        self,
        *,
        memory: PagedMemory,
        plan: Callable[["adapters.LoadedAdapter"], AdapterPlan],
        load: Callable[[Path, str], "adapters.LoadedAdapter"],  # (path, the digest it is registered by)
        take_pages: Callable[[int], list[int]],
        give_pages: Callable[[list[int]], None],
        host_cache_bytes: int,
        pin_pages: int = 0,
        mirror: Mirror | None = None,
    ) -> None:
        self.memory = memory
        self._mirror = mirror
        self._plan = plan
        self._load = load
        self._take_pages = take_pages
        self._give_pages = give_pages
        self.host_cache_bytes = host_cache_bytes
        self.pin_pages = pin_pages  # device pages that pins may hold in all
        self._pins: dict[str, str] = {}  # digest -> the tier it is pinned in
        self._paths: dict[str, Path] = {}
        self._host: OrderedDict[str, AdapterPlan] = OrderedDict()  # LRU first
        self._host_bytes = 0
        self._resident: dict[str, Resident] = {}
        self._placing: dict[str, Placing] = {}  # copies under way of adapters not resident until they are done
        self._copying: dict[str, Placing] = {}  # copies under way of resident adapters (a copier that streams)
        self._idle: OrderedDict[str, None] = OrderedDict()  # resident, no user; LRU first
        self._loading: set[str] = set()
        self._failed: dict[str, str] = {}  # digest -> reason: loads that failed, until the adapter is asked for again
        self._unreported: dict[str, str] = {}  # failed loads `take_failures` has not handed out yet
        self.generation = 0  # bumped whenever an adapter is placed or dropped
        self.num_loads = {"host": 0, "device": 0}
        self.num_evictions = {"host": 0, "device": 0}
        self._load_times: deque[LoadTime] = deque(maxlen=4096)  # until take_load_times (bounded: an offline
        # engine never takes them)
        self._mean_load_seconds: dict[str, float] = {}  # "disk_host" / "host_device" -> running mean (routing's)
        self._copier = page_copier(memory)
        # tensor-parallel workers copy their own shards: their sequences wait for every rank's whole copy
        self._streamed = self._copier.streams_layers and mirror is None
        self._requests: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        # the loader holds the pool weakly (a thread running a bound method would keep the pool, its pages and,
        # through `plan` and `load`, the engine alive for good); dropping the pool stops it
        self._thread = threading.Thread(target=_load_in_background, args=(weakref.ref(self), self._requests),
                                        name="adapter-loader", daemon=True)
        self._thread.start()
        self._stop_loader = weakref.finalize(self, self._requests.put, None)

    def close(self) -> None:
        """Stop the loader and let go of every tier (the engine runs no step after this); twice is harmless."""
        self._stop_loader()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._copier.close()
        self._host.clear()
        self._resident.clear()
        self._placing.clear()
        self._copying.clear()
        self._idle.clear()
        self._pins.clear()
        self._host_bytes = 0

    # registration
    def register(self, digest: str, path: str | Path) -> None:
        self._paths[digest] = Path(path)
        self._failed.pop(digest, None)
        self._unreported.pop(digest, None)

    def plan(self, adapter: "adapters.LoadedAdapter") -> AdapterPlan:
        """Lay an adapter out for the pages (raises AdapterError if it does not fit this model); any thread."""
        return self._plan(adapter)

    def prepare(self, adapter: "adapters.LoadedAdapter") -> Prepared:
        """`plan`, and the mirror's part of the adapter: the work of `add_loaded`, off the engine thread."""
        return Prepared(self._plan(adapter), None if self._mirror is None else self._mirror.pack(adapter))

    def add_loaded(self, adapter: "adapters.LoadedAdapter | Prepared", path: str | Path, *,
                   seconds: float | None = None) -> None:
        """Register an adapter already read (or prepared) into the host tier; `seconds`: how long its read took
        (a disk -> host load time)."""
        prepared = adapter if isinstance(adapter, Prepared) else self.prepare(adapter)
        self.register(prepared.plan.digest, path)
        self._put_host(prepared)
        if seconds is not None:
            self._moved(LoadTime("disk", "host", seconds))

    def is_registered(self, digest: str) -> bool:
        return digest in self._paths

    def forget(self, digest: str) -> None:
        """Unregister an adapter no request uses, dropping it from every tier."""
        self._pins.pop(digest, None)
        self.evict(digest)
        self._paths.pop(digest, None)
        self._failed.pop(digest, None)
        self._unreported.pop(digest, None)

    # tiers
    def tier(self, digest: str) -> str:
        """"device" (with a copier that streams layers, also while its copy is under way), "host" (also while its
        copy into pages is under way: `state()["placing"]`), "loading", "failed" or "disk" (registered, in no memory
        tier)."""
        self._drain()
        if digest in self._resident:
            return "device"
        if digest in self._host:
            return "host"
        return "loading" if digest in self._loading else "failed" if digest in self._failed else "disk"

    def resident(self) -> dict[str, list[str]]:
        """Digests in each memory tier."""
        self._drain()
        return {"device": list(self._resident), "host": list(self._host)}

    def ready(self, digest: str) -> bool:
        """Whether the adapter is resident on the device, its copy done (a sequence can use it in the next step).
        If it is in no memory tier, make sure it is being read from disk: a load that failed is tried again (read
        anew) once `take_failures` has handed its failure out. One in host memory waits for `place`."""
        self._drain()
        if digest in self._resident:
            return True
        if digest in self._host or digest in self._placing:
            return False
        if digest not in self._unreported and digest not in self._loading:
            self._failed.pop(digest, None)
            self._loading.add(digest)
            self._requests.put((digest, self._paths[digest]))
        return False

    def read_into_host(self, digest: str) -> None:
        """Start a read from disk of an adapter not in host memory, also one resident on the device whose host copy
        the LRU let go (`ready` reads only what is in no memory tier)."""
        self._drain()
        if digest in self._host or digest in self._loading:
            return
        self._failed.pop(digest, None)
        self._loading.add(digest)
        self._requests.put((digest, self._paths[digest]))

    def is_loading(self, digest: str) -> bool:
        """Whether a read of the adapter from disk is under way."""
        self._drain()
        return digest in self._loading

    def residency(self) -> list[Residency]:
        """Every adapter in the device and host tiers (one entry per tier it is in), device first."""
        self._drain()
        pins = self._pins
        return [*(Residency(d, "device", pins.get(d) == "device", r.plan.max_rank) for d, r in self._resident.items()),
                *(Residency(d, "host", pins.get(d) == "host", plan.max_rank) for d, plan in self._host.items())]

    # pins
    def pin(self, digest: str, tier: str) -> None:
        """Keep an adapter, already in `tier` ("host" or "device", its copy done), there until `unpin`: no LRU,
        `reclaim` or `evict` takes it out. A pin in the other tier moves to this one. PinRefused, naming the
        numbers, when the adapter is not in that tier or the tier's pins would pass its budget."""
        self._drain()
        if tier == "device":
            resident = self._resident.get(digest)
            if resident is None:
                raise PinRefused(f"adapter {digest[:12]} is not on the device")
            held = sum(len(self._resident[d].pages) for d, t in self._pins.items() if t == "device" and d != digest)
            if held + len(resident.pages) > self.pin_pages:
                raise PinRefused(f"device pins would hold {held + len(resident.pages)} pages ({len(resident.pages)} "
                                 f"for adapter {digest[:12]}); the pool has {self.pin_pages} pages for adapters")
        elif tier == "host":
            plan = self._host.get(digest)
            if plan is None:
                raise PinRefused(f"adapter {digest[:12]} is not in host memory")
            held = sum(self._host[d].num_bytes for d, t in self._pins.items() if t == "host" and d != digest)
            if held + plan.num_bytes > self.host_cache_bytes:
                raise PinRefused(f"host pins would hold {held + plan.num_bytes} bytes ({plan.num_bytes} for adapter "
                                 f"{digest[:12]}); the host tier holds {self.host_cache_bytes}")
        else:
            raise ValueError(f"tier must be 'host' or 'device', not {tier!r}")
        self._pins[digest] = tier

    def unpin(self, digest: str) -> str | None:
        """Let the adapter be evicted again; returns the tier it was pinned in (None: it was not)."""
        return self._pins.pop(digest, None)

    def pins(self) -> dict[str, str]:
        """digest -> the tier it is pinned in."""
        return dict(self._pins)

    def pin_fits(self, digest: str, tier: str) -> str | None:
        """Why a device pin of an adapter in host memory would be refused once placed (None: it would fit), so
        that no page is taken for a pin that cannot be kept."""
        plan = self._host.get(digest)
        if tier != "device" or plan is None or digest in self._resident:
            return None
        held = sum(len(self._resident[d].pages) for d, t in self._pins.items() if t == "device" and d != digest)
        if held + plan.num_pages <= self.pin_pages:
            return None
        return (f"device pins would hold {held + plan.num_pages} pages ({plan.num_pages} for adapter "
                f"{digest[:12]}); the pool has {self.pin_pages} pages for adapters")

    def _moved(self, move: LoadTime) -> None:
        self._load_times.append(move)
        key = f"{move.from_tier}_{move.to_tier}"
        mean = self._mean_load_seconds.get(key)
        self._mean_load_seconds[key] = move.seconds if mean is None else mean + LOAD_MEAN_WEIGHT * (move.seconds - mean)

    def take_load_times(self) -> list[LoadTime]:
        """The moves between tiers finished since the last call."""
        self._drain()
        times = list(self._load_times)
        self._load_times.clear()
        return times

    def failures(self) -> dict[str, str]:
        """digest -> reason for every adapter whose last load failed (until it is asked for or registered again)."""
        self._drain()
        return dict(self._failed)

    def take_failures(self) -> dict[str, str]:
        """digest -> reason for the loads that failed since the last call: the requests waiting for those adapters
        fail; a request that asks for one afterwards gets a new load."""
        self._drain()
        failed, self._unreported = self._unreported, {}
        return failed

    # device pages
    def pages_to_place(self, digest: str) -> int | None:
        """The pages `place` would take: None unless the adapter is in host memory and neither resident nor
        being placed."""
        self._drain()
        if digest in self._resident or digest in self._placing:
            return None
        plan = self._host.get(digest)
        return None if plan is None else plan.num_pages

    def place(self, digest: str) -> None:
        """Take the adapter's pages (the caller made sure pages_to_place(digest) are free) and start its copy into
        them; it is resident once the copy is done (`ready`)."""
        plan = self._host[digest]
        self._host.move_to_end(digest)
        pages = self._take_pages(plan.num_pages)
        if self._mirror is not None:
            self._mirror.place(digest, pages)
        mem = self.memory
        offsets = plan.page_offsets(pages, chunk=mem.chunk, chunk_start=mem.chunk_start, zero_row=mem.zero_row)
        placing = Placing(plan, pages, self._copier.start(plan, pages, offsets))
        if not self._streamed:
            self._placing[digest] = placing
            return
        self._copying[digest] = placing  # resident now: a step waits for each layer's copy (`copies_under_way`)
        self._make_resident(digest, placing, placing.copy.tables())

    def copies_under_way(self, digests: list[str]) -> list[Copy]:
        """The copies not done yet of these resident adapters: a step that uses them waits for each layer's."""
        self._drain()
        return [self._copying[d].copy for d in digests if d in self._copying] if self._copying else []

    def wait_placed(self, digest: str) -> None:
        """Block until the adapter's copy into pages, if one is under way, is done."""
        placing = self._placing.get(digest) or self._copying.get(digest)
        if placing is not None:
            placing.copy.result()
            self._drain()

    def acquire(self, digest: str) -> None:
        """Keep a resident adapter on the device for one more running sequence."""
        self._resident[digest].users += 1
        self._idle.pop(digest, None)

    def release(self, digest: str) -> None:
        resident = self._resident[digest]
        resident.users -= 1
        if resident.users == 0:
            self._idle[digest] = None

    def reclaim(self, num_pages: int, *, keep: Collection[str] = ()) -> int:
        """Evict idle adapters not in `keep` and not pinned on the device, least recently used first, until
        num_pages pages are freed; returns the pages freed (fewer when not enough could go)."""
        freed = 0
        for digest in list(self._idle):
            if freed >= num_pages:
                break
            if digest not in keep and self._pins.get(digest) != "device" and digest not in self._copying:
                freed += self._drop(digest)
        return freed

    def evict(self, digest: str) -> list[str]:
        """Drop an adapter from the device (if no sequence uses it; a copy under way is finished first) and the
        host cache; returns the tiers it left. RuntimeError for a pinned adapter."""
        if digest in self._pins:
            raise RuntimeError(f"adapter {digest[:12]} is pinned in the {self._pins[digest]} tier: unpin it first")
        self.wait_placed(digest)
        left = []
        if digest in self._resident:
            if self._resident[digest].users:
                raise RuntimeError(f"adapter {digest[:12]} is in use")
            self._drop(digest)
            left.append("device")
        if digest in self._host:
            self._drop_host(digest)
            left.append("host")
        return left

    def slot_tables(self, digests: list[str]) -> list[AdapterTables]:
        """The tables of resident adapters, in the order of `digests`, as LoRABatch.fill takes them."""
        out = []
        for digest in digests:
            r = self._resident[digest]
            if r.tables is None:
                device = r.offsets[0].device
                r.tables = AdapterTables(key=r.placement, offsets=r.offsets[0], expert_offsets=r.offsets[1],
                                         ranks=r.plan.ranks.to(device), scaling=r.plan.scaling.to(device),
                                         host_ranks=r.plan.ranks, a_source=r.plan.a_source)
            out.append(r.tables)
        return out

    @property
    def num_pages(self) -> int:
        """Pages held by adapters: resident, or taken for a copy under way."""
        return sum(len(r.pages) for r in self._resident.values()) + sum(len(p.pages) for p in self._placing.values())

    def _finish_placing(self) -> None:
        """Adapters whose copy is done become resident, unpinned; streamed copies that are done are no longer
        waited for."""
        for digest, placing in list(self._placing.items()):
            if not placing.copy.done():
                continue
            del self._placing[digest]
            offsets = placing.copy.result()  # a failed copy into our own pages is a bug: it raises
            self._moved(LoadTime("host", "device", placing.copy.seconds()))
            self._make_resident(digest, placing, offsets)
        for digest, placing in list(self._copying.items()):
            if placing.copy.done():
                del self._copying[digest]
                placing.copy.result()
                self._moved(LoadTime("host", "device", placing.copy.seconds()))

    def _make_resident(self, digest: str, placing: Placing, offsets: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.generation += 1
        self._resident[digest] = Resident(plan=placing.plan, pages=placing.pages, offsets=offsets,
                                          placement=self.generation)
        self._idle[digest] = None
        self.num_loads["device"] += 1

    def _drop(self, digest: str) -> int:
        resident = self._resident.pop(digest)
        self._idle.pop(digest, None)
        self._give_pages(resident.pages)
        self.generation += 1
        self.num_evictions["device"] += 1
        return len(resident.pages)

    def _put_host(self, prepared: Prepared) -> None:
        plan = prepared.plan
        old = self._host.pop(plan.digest, None)
        self._host_bytes += plan.num_bytes - (old.num_bytes if old else 0)
        self._host[plan.digest] = plan
        self.num_loads["host"] += old is None
        if old is None and self._mirror is not None:
            self._mirror.hold(plan.digest, prepared.packed)
        for digest in list(self._host):
            if self._host_bytes <= self.host_cache_bytes:
                break
            if digest != plan.digest and self._pins.get(digest) != "host":
                self._drop_host(digest)

    def _drop_host(self, digest: str) -> None:
        self._host_bytes -= self._host.pop(digest).num_bytes
        self.num_evictions["host"] += 1
        if self._mirror is not None:
            self._mirror.drop(digest)

    # loading
    def _load_one(self, digest: str, path: Path) -> None:
        started = time.perf_counter()
        try:
            adapter = self._load(path, digest)
            if adapter.digest != digest:
                raise adapters.AdapterError("digest_mismatch", f"its content has digest {adapter.digest[:12]}")
            self._results.put((digest, self.prepare(adapter), time.perf_counter() - started, None))
        except Exception as error:  # every loader failure fails only this adapter's requests
            self._results.put((digest, None, None, failure_reason(error)))

    def _drain(self) -> None:
        if self._placing or self._copying:
            self._finish_placing()
        while True:
            try:
                digest, prepared, seconds, error = self._results.get_nowait()
            except queue.Empty:
                return
            self._loading.discard(digest)
            if digest not in self._paths:
                continue
            if error is not None:
                self._failed[digest] = self._unreported[digest] = error
            else:
                self._put_host(prepared)
                self._moved(LoadTime("disk", "host", seconds))

    def state(self) -> dict:
        self._drain()
        return {
            "device": list(self._resident),
            "gpu": list(self._resident),  # the device tier's name in the server API (also on CPU)
            "host": list(self._host),
            "host_bytes": self._host_bytes,
            "device_pages": self.num_pages,
            "pinned": dict(self._pins),  # digest -> tier
            "in_use": sorted(d for d, r in self._resident.items() if r.users),
            "residency": [r._asdict() for r in self.residency()],  # per adapter and memory tier, as in /metrics
            "placing": sorted([*self._placing, *self._copying]),  # copies into pages under way
            "loading": sorted(self._loading),
            "failed": dict(self._failed),
            "registered": len(self._paths),
            "load_seconds": dict(self._mean_load_seconds),  # running means of its moves: what routing weighs
        }


def _load_in_background(pool_ref: "weakref.ref[AdapterPool]", requests: queue.Queue) -> None:
    """The loader thread: disk -> host for each (digest, path) asked for, until None or the pool is gone. The
    pool is held only while one adapter loads."""
    while (item := requests.get()) is not None:
        pool = pool_ref()
        if pool is None:
            return
        pool._load_one(*item)
        del pool
