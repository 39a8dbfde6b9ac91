"""KV blocks between engines over NIXL (UCX underneath: RDMA, NVLink, CUDA IPC or TCP, whichever both ends have).

Each engine registers two regions with its NIXL agent once, when it starts: its page pool (every layer's K/V pages
and, for an fp8 cache, their scales: device memory on CUDA, host memory on CPU), which it writes from as a source,
and a landing area of `slots` blocks of the same layout, which a source writes into when this engine pulls.

A pull is a push (a one-sided WRITE by the source), driven by the lease's WebSocket (engine/kv/transport.py):

    puller                                              source
    pull {keys, via: nixl, nixl: target}     ------->   loads the puller's agent metadata (once per agent), takes
                                                        the leased pages, writes each block's K/V chunks (and
                                                        scales) from its pool into the puller's landing slots
                                             <-------   blocks {via: nixl, keys, sums} once the write is complete
    copies the slots out, checks each block's sum, import_blocks (every key checked again), then done

`target` is the puller's agent name and metadata (base64), its landing area's addresses, the slots reserved for
this pull and the KV layout; a source whose layout differs writes nothing. The sums are engine/kv/payload.py's
`block_sums`, computed by the source over its pages and by the puller over the copy it installs: a block whose
sum differs (a write cut short, a late write, a page mixed up) is refused and recomputed, never served.

Why the landing area and not the puller's own pages: a write the puller gave up on (a source that stalled past the
timeout) may still land. Into the landing area it does no harm: the slots of a pull that failed rest for the
transfer timeout before another pull takes them, and whatever lands in them later fails the next pull's sums. Pages
that sequences read are never registered.
"""

import asyncio
import base64
import collections
import contextlib
import importlib
import logging
import secrets
import time
from dataclasses import asdict

import torch

from engine.kv.payload import KVBlock, KVLayout, block_sums, page_sums
from engine.paged_memory import PagedMemory

log = logging.getLogger(__name__)

MODULES = ("nixl_cu12", "nixl_cu13", "nixl")  # the wheels for CUDA 12, CUDA 13, and the meta package
POLL_S = (0.0002, 0.002)  # a write's state is checked at the first interval, doubling up to the second
PROGRESS_S = 0.0005  # how often a puller drives its agent while a source writes to it
MAX_PEERS = 256  # pullers whose metadata a source keeps loaded; the least recently written-to is dropped past it


class NixlUnavailable(RuntimeError):
    """NIXL cannot be used here (the package does not import, or its agent cannot start): the reason."""


def nixl_api():
    """The package's (nixl_agent, nixl_agent_config, nixl_thread_sync_t); NixlUnavailable naming why not."""
    reasons = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
            return module.nixl_agent, module.nixl_agent_config, module.nixl_thread_sync_t
        except ImportError as error:
            reasons.append(f"{name}: {error}")
    raise NixlUnavailable("the nixl package does not import (" + "; ".join(reasons) + ")")


def nixl_available() -> bool:
    try:
        nixl_api()
    except NixlUnavailable:
        return False
    return True


class NixlError(Exception):
    """A NIXL write that did not complete, or a target this source cannot write to; `code` as TransferError's."""

    def __init__(self, message: str, *, code: str = "closed") -> None:
        super().__init__(message)
        self.code = code


class NixlEndpoint:
    """One engine's NIXL agent with its pool and its landing area registered. Driven from one event loop thread (the
    engine server's); `sums` and `received` read the pool and the landing area on the engine thread."""

    def __init__(self, memory: PagedMemory, *, name: str, landing_blocks: int, rest_s: float = 10.0,
                 max_peers: int = MAX_PEERS) -> None:
        nixl_agent, nixl_agent_config, sync = nixl_api()
        self.memory = memory
        self.layout = KVLayout.of(memory)
        self.device = memory.layers[0].device
        self.mem_type = "VRAM" if self.device.type == "cuda" else "DRAM"
        self.device_id = (self.device.index or 0) if self.device.type == "cuda" else 0
        self.rest_s = rest_s
        self.name = f"quilt-{name}-{secrets.token_hex(4)}"
        try:
            # No progress thread: NIXL's spins a core even when idle. The source drives its own writes
            # (check_xfer_state) and a puller drives its agent while it waits for one (progressing): UCX over TCP
            # needs both.
            self.agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                                                 sync_mode=sync.NIXL_THREAD_SYNC_STRICT))
        except Exception as error:  # UCX could not start: no transport it can use here
            raise NixlUnavailable(f"the NIXL agent did not start: {error}") from error
        if "UCX" not in self.agent.backends:
            raise NixlUnavailable("NIXL has no UCX backend here")
        lay = self.layout
        count = max(1, landing_blocks)
        self.landing = torch.zeros((count, lay.num_layers, 2, lay.half_bytes), dtype=torch.uint8, device=self.device)
        self.landing_scales = torch.zeros((count, lay.num_layers, 2, lay.scale_values), dtype=torch.float32,
                                          device=self.device) if lay.scales else None
        regions = [*memory.layers, *(memory.scales or []), self.landing]
        if self.landing_scales is not None:
            regions.append(self.landing_scales)
        try:
            self.registered = self.agent.register_memory(regions)
        except Exception as error:  # e.g. device memory with a UCX built without CUDA
            raise NixlUnavailable(f"NIXL cannot register the {self.mem_type} of the KV pool: {error}") from error
        self.free_slots = list(range(count))
        self.resting: list[tuple[float, list[int]]] = []  # (when they may be taken again, slots)
        # agents whose metadata is loaded, the most recently written-to last: a puller that restarts comes back
        # as a new agent, so the old ones are dropped rather than kept for the source's life
        self.peers: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.max_peers = max_peers
        self.metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()

    @property
    def slots(self) -> int:
        return self.landing.shape[0]

    def close(self) -> None:
        for peer in list(self.peers):
            self.agent.remove_remote_agent(peer)
        self.peers.clear()
        self.agent.deregister_memory(self.registered)

    # the puller's side
    def reserve(self, count: int) -> list[int] | None:
        """`count` landing slots for one pull, or None when fewer are free (the pull goes another way)."""
        now = time.monotonic()
        for entry in [entry for entry in self.resting if entry[0] <= now]:
            self.resting.remove(entry)
            self.free_slots.extend(entry[1])
        if count > len(self.free_slots):
            return None
        taken, self.free_slots = self.free_slots[:count], self.free_slots[count:]
        return taken

    def give_back(self, slots: list[int], *, failed: bool) -> None:
        """Slots after their pull; after a failed one they rest first (a write may still land in them)."""
        if failed:
            self.resting.append((time.monotonic() + self.rest_s, slots))
        else:
            self.free_slots.extend(slots)

    @contextlib.asynccontextmanager
    async def progressing(self):
        """While a source writes into this engine's landing slots: drive this agent's UCX worker (a write over TCP
        completes only as the target reads it off the socket)."""

        async def drive() -> None:
            while True:
                self.agent.get_new_notifs()
                await asyncio.sleep(PROGRESS_S)

        task = asyncio.get_running_loop().create_task(drive(), name="nixl-progress")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def target(self, slots: list[int]) -> dict:
        """What the `pull` header tells the source: where to write, and who this is."""
        return {"agent": self.name, "metadata": self.metadata, "layout": asdict(self.layout), "slots": slots,
                "mem": self.mem_type, "device": self.device_id, "kv": self.landing.data_ptr(),
                "scales": None if self.landing_scales is None else self.landing_scales.data_ptr()}

    def received(self, slots: list[int], keys: list[bytes], sums: list[int]) -> tuple[list[KVBlock], int | None]:
        """Engine thread: the blocks written into `slots`, copied out, under `keys`, up to the first whose sum is
        not the source's (its index, else None)."""
        index = torch.tensor(slots[: len(keys)], dtype=torch.int64, device=self.device)
        kv = self.landing.index_select(0, index)
        scales = None if self.landing_scales is None else self.landing_scales.index_select(0, index)
        got = block_sums(kv, scales)
        bad = next((i for i, (a, b) in enumerate(zip(got, sums, strict=True)) if a != b), None)
        good = len(keys) if bad is None else bad
        return [KVBlock(key=key, layout=self.layout, kv=kv[i], scales=None if scales is None else scales[i])
                for i, key in enumerate(keys[:good])], bad

    # the source's side
    def sums(self, block_ids: list[int]) -> list[int]:
        """Engine thread: the sums of the pages about to be written."""
        return page_sums(self.memory, block_ids)

    def _peer(self, target: dict) -> str:
        agent = target.get("agent")
        if not isinstance(agent, str) or not agent:
            raise NixlError("the target names no agent", code="protocol")
        if agent in self.peers:
            self.peers.move_to_end(agent)
            return agent
        try:
            loaded = self.agent.add_remote_agent(base64.b64decode(str(target.get("metadata"))))
        except Exception as error:
            raise NixlError(f"the puller's NIXL metadata cannot be loaded: {error}", code="protocol") from error
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != agent:
            if loaded not in self.peers:
                self.agent.remove_remote_agent(loaded)
            raise NixlError(f"the metadata is agent {loaded!r}'s, not {agent!r}", code="protocol")
        self.peers[agent] = None
        while len(self.peers) > self.max_peers:
            self.agent.remove_remote_agent(self.peers.popitem(last=False)[0])
        return agent

    def descriptors(self, block_ids: list[int], target: dict, *, swap_first: bool = False) -> tuple[list, list]:
        """(local, remote) (address, bytes, device) lists: each block's chunks, page by page into slot by slot.
        swap_first: the first chunk comes from another page (the fault injection's corrupted block)."""
        lay = self.layout
        if target.get("layout") != asdict(lay):
            raise NixlError(f"the puller's KV layout {target.get('layout')} is not this pool's {asdict(lay)}",
                            code="mismatch")
        slots = target.get("slots")
        if not isinstance(slots, list) or len(slots) < len(block_ids) or not all(isinstance(s, int) for s in slots):
            raise NixlError("the target has fewer landing slots than blocks", code="protocol")
        if target.get("mem") not in ("DRAM", "VRAM") or not isinstance(target.get("kv"), int):
            raise NixlError("the target's memory is not described", code="protocol")
        remote_device = int(target.get("device") or 0)
        local, remote = [], []
        pages = list(block_ids)
        if swap_first and pages:
            pages_from = [self.memory.num_pages if pages[0] != self.memory.num_pages else 0] + pages[1:]
        else:
            pages_from = pages
        parts = [(self.memory.layers, lay.half_bytes, target["kv"])]
        if lay.scales:
            parts.append((self.memory.scales, lay.scale_values * 4, target.get("scales")))
        for tensors, size, base in parts:
            if not isinstance(base, int):
                raise NixlError("the target's scale memory is not described", code="protocol")
            slot_bytes = lay.num_layers * 2 * size
            for i, page in enumerate(pages_from):
                for layer, t in enumerate(tensors):
                    for half in (0, 1):
                        at = t.data_ptr() + (half * t.shape[1] + page) * size
                        local.append((at, size, self.device_id))
                        remote.append((base + slots[i] * slot_bytes + (2 * layer + half) * size, size, remote_device))
        return local, remote

    async def write(self, local: list, remote: list, target: dict, *, deadline_s: float) -> None:
        """WRITE local into the puller's memory and wait for it to complete; NixlError if it fails or outlasts
        deadline_s."""
        if not local:
            return
        peer = self._peer(target)
        handle = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(local, self.mem_type),
                                            self.agent.get_xfer_descs(remote, target["mem"]), peer)
        try:
            state = self.agent.transfer(handle)
            deadline, pause = time.monotonic() + deadline_s, POLL_S[0]
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise NixlError(f"the NIXL write outlasted {deadline_s:g} s", code="timeout")
                await asyncio.sleep(pause)
                pause = min(pause * 2, POLL_S[1])
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise NixlError(f"the NIXL write failed ({state})")
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as error:  # a write still in flight: NIXL keeps the handle until it ends
                log.warning("a NIXL write handle could not be released yet: %s", error)
