"""The engine's side of disaggregated serving (docs/kv-tiers.md, "Transfer", "Leases", "Failure rules").

As a source (a prefill hop, `kv_transfer.mode = "prefill"`): the request's end grants a lease on the prompt's full
blocks (EngineLoop), and a TransferServer hands them out, once, to the engine that names the lease; the lease ends
when that engine is done, gives up or hangs up, when its TTL passes, or when this engine drains.

As a puller (a decode hop, `mode = "decode"`): before the request is submitted, the engine computes the prompt's
keys itself, asks the lease's source for those it lacks (neither in its pool nor in its host tier, whose blocks
come back at admission), installs what arrives through `import_blocks` (which re-checks every key) and tells the
source it is done. The bytes move by the engine's `--kv-transfer-backend`: NIXL (the source writes them into this
engine's registered landing area, engine/kv/nixl.py) when both ends have it, else shared memory when the source is
on this host and offers it, else TCP. Any failure (the
source gone, a timeout, a refused lease, a lease this engine cannot read, a corrupt payload, a key that is not this
engine's) leaves the missing blocks to be recomputed, counted and logged; mismatched KV is never installed, so never
served.
"""

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import msgspec
import torch

from engine.contract.kv import KVLease, LeaseTransport
from engine.kv.faults import Fault, FaultyTransport, InjectedFault
from engine.kv.lease import Lease
from engine.kv.nixl import NixlEndpoint, NixlError, NixlUnavailable
from engine.kv.payload import KVBlock, KVLayout, PayloadError, decode, encode, held_run, read_pages
from engine.kv.transport import LeaseRefused, Pull, TransferError, TransferServer, channel_for, release_remote
from engine.llm_engine import LLMEngine
from engine.server.engine_loop import EngineLoop
from engine.server.protocol import GenerateRequest

log = logging.getLogger(__name__)

EXPIRY_INTERVAL_S = 0.5
BACKENDS = ("nixl", "shm", "tcp")


@dataclass
class PullReport:
    """What a decode hop got from its lease: in its usage as `kv_transfer`."""

    lease_id: str
    blocks_pulled: int = 0
    recomputed: bool = False  # some blocks the lease was for were computed here instead
    reason: str | None = None  # why (metrics and logs; not sent)
    via: str | None = None  # "tcp", "shm" or "nixl": how the blocks came (None: nothing was pulled)

    def as_json(self) -> dict:
        return {"lease_id": self.lease_id, "blocks_pulled": self.blocks_pulled, "recomputed": self.recomputed}


def address_of(lease: KVLease) -> dict:
    """The lease's transport as engine.kv.transport takes an address."""
    return msgspec.to_builtins(lease.transport)


@dataclass
class PendingPull:
    task: asyncio.Task
    aborted: bool = False  # POST /v1/abort came during the pull: the request ends as aborted once submitted


class KVTransfers:
    """backend: "nixl" (NIXL where it imports and its agent starts, else shared memory and TCP, said in one log line),
    "shm" (shared memory on one host, else TCP) or "tcp". landing_mb: the NIXL landing area (at most a quarter of
    the pool). fault: every pull this engine serves goes wrong so (tests, engine/kv/faults.py)."""

    def __init__(self, loop: EngineLoop, *, engine_id: str, host: str, advertise_host: str, port: int = 0,
                 shm: bool = True, timeout_s: float = 10.0, backend: str = "nixl", landing_mb: float = 256.0,
                 fault: Fault | None = None) -> None:
        assert backend in BACKENDS, backend
        self.loop = loop
        self.metrics = loop.metrics
        self.engine_id = engine_id
        self.timeout_s = timeout_s
        self.backend = backend
        self.landing_mb = landing_mb
        self.fault = fault
        self.nixl: NixlEndpoint | None = None
        self.shm = shm and backend != "tcp"
        self.server = TransferServer(blocks=self._blocks, release=self._release, host=host, port=port,
                                     advertise_host=advertise_host, shm=self.shm, push=self._push,
                                     wrap=None if fault is None else self._faulty)
        self.pending: dict[str, PendingPull] = {}  # request id -> its pull under way
        self._releases: set[asyncio.Task] = set()
        self._expiry: asyncio.Task | None = None

    async def start(self) -> None:
        why_not = None
        if self.backend == "nixl":
            try:
                self.nixl = await self.loop.call(self._nixl_endpoint)
            except NixlUnavailable as error:
                why_not = str(error)
        if self.nixl is None:
            self.backend = "shm" if self.shm else "tcp"
        self.server.nixl = None if self.nixl is None else self.nixl.name
        await self.server.start()
        self._expiry = asyncio.get_running_loop().create_task(self._expire_forever(), name="kv-lease-expiry")
        address = self.server.address
        if self.nixl is not None:
            used = f"nixl (agent {self.nixl.name}, {self.nixl.slots} landing blocks)"
        else:
            used = self.backend + (f" (nixl is not used: {why_not})" if why_not else "")
        log.info("KV transfer backend: %s; the control channel on %s, shared memory %s", used, address["tcp"],
                 address["shm"] or "off")

    def _nixl_endpoint(self, engine: LLMEngine) -> NixlEndpoint:
        """Engine thread: the NIXL agent with this engine's pool and a landing area registered."""
        if engine.workers is not None:
            raise NixlUnavailable("a tensor-parallel engine moves no KV between engines")
        layout = KVLayout.of(engine.memory)
        block_bytes = layout.num_layers * 2 * (layout.half_bytes + layout.scale_values * 4)
        slots = min(int(self.landing_mb * (1 << 20)) // block_bytes, engine.memory.num_pages // 4)
        return NixlEndpoint(engine.memory, name=self.engine_id, landing_blocks=max(1, slots), rest_s=self.timeout_s)

    def _faulty(self, transport):
        return FaultyTransport(transport, self.fault, stall_s=self.timeout_s + 1.0)

    async def close(self) -> None:
        """Drain: no more pulls; every lease still held is released."""
        if self._expiry is not None:
            self._expiry.cancel()
        await self.server.close()
        if self.nixl is not None:
            with contextlib.suppress(Exception):
                self.nixl.close()
        with contextlib.suppress(Exception):  # the engine loop may be gone already: its pool with it
            ended = await self.loop.call(lambda engine: self.loop.leases.release_all("drain"))
            if ended:
                log.info("released %d KV leases on drain", ended)

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_INTERVAL_S)
            with contextlib.suppress(Exception):
                ended = await self.loop.call(lambda engine: self.loop.leases.expire())
                for lease_id in ended:
                    log.warning("KV lease %s expired unpulled: its blocks are back in the prefix cache", lease_id)

    # the source side
    def lease(self, lease: Lease, ttl_s: float) -> KVLease:
        """The lease as a prefill hop answers it."""
        return KVLease(id=lease.id, engine_id=self.engine_id, transport=msgspec.convert(self.server.address, LeaseTransport),
                       num_blocks=len(lease.block_ids), num_tokens=lease.num_tokens, expires_in_s=ttl_s)  # fmt: skip

    async def _blocks(self, lease_id: str, keys: list[str]) -> list[bytes]:
        try:
            wanted = [bytes.fromhex(key) for key in keys]
        except ValueError:
            raise LeaseRefused("keys must be hex strings", code="protocol") from None
        blocks = await self.loop.call(lambda engine: self._export(engine, lease_id, wanted))
        payloads = await asyncio.to_thread(lambda: [encode([block]) for block in blocks])  # off both threads
        self.metrics.kv_transfer_blocks.labels(direction="sent").inc(len(blocks))
        return payloads

    def _export(self, engine: LLMEngine, lease_id: str, keys: list[bytes]) -> list[KVBlock]:
        """Engine thread: copies of the leased blocks asked for. On CUDA through page-locked staging buffers, the
        copies queued without blocking and waited for once."""
        taken, block_ids = self._take(lease_id, keys)
        if not taken:
            return []
        cuda = engine.device.type == "cuda"
        kv, scales = read_pages(engine.memory, block_ids, pin=cuda, non_blocking=cuda)
        if cuda:
            torch.cuda.current_stream(engine.device).synchronize()
        layout = KVLayout.of(engine.memory)
        return [KVBlock(key=key, layout=layout, kv=kv[i], scales=None if scales is None else scales[i])
                for i, key in enumerate(taken)]

    async def _push(self, lease_id: str, keys: list[str], target: dict) -> dict:
        """A pull over NIXL: write the leased blocks asked for into the puller's landing slots, then the `blocks`
        header (their keys and sums)."""
        if self.nixl is None:
            raise TransferError("this engine does not move KV over NIXL", code="protocol")
        try:
            wanted = [bytes.fromhex(key) for key in keys]
        except ValueError:
            raise LeaseRefused("keys must be hex strings", code="protocol") from None
        taken, block_ids, sums = await self.loop.call(lambda engine: self._pages(lease_id, wanted))
        if not taken:  # none of the asked keys is leased (another adapter, tenant or numerics): nothing to write
            return {"op": "blocks", "via": "nixl", "keys": [], "sums": []}
        try:
            if self.fault == Fault.STALL:
                await asyncio.sleep(self.timeout_s + 1.0)
            local, remote = self.nixl.descriptors(block_ids, target, swap_first=self.fault == Fault.CORRUPT)
            if self.fault == Fault.FAIL_HALFWAY:
                await self.nixl.write(local[: len(local) // 2], remote[: len(remote) // 2], target,
                                      deadline_s=self.timeout_s)
                raise InjectedFault(f"dropped after half of {len(taken)} blocks")
            await self.nixl.write(local, remote, target, deadline_s=self.timeout_s)
        except NixlError as error:
            raise TransferError(str(error), code=error.code) from error
        self.metrics.kv_transfer_blocks.labels(direction="sent").inc(len(taken))
        return {"op": "blocks", "via": "nixl", "keys": [key.hex() for key in taken], "sums": sums}

    def _take(self, lease_id: str, keys: list[bytes]) -> tuple[list[bytes], list[int]]:
        """Engine thread: the leased blocks asked for (LeaseTable.take: once per lease) and their pages."""
        taken = self.loop.leases.take(lease_id, keys)
        if not taken:
            return [], []
        lease = self.loop.leases.leases[lease_id]
        where = dict(zip(lease.keys, lease.block_ids, strict=True))
        return taken, [where[key] for key in taken]

    def _pages(self, lease_id: str, keys: list[bytes]) -> tuple[list[bytes], list[int], list[int]]:
        """Engine thread: the leased blocks asked for, their pages, and the pages' sums."""
        taken, block_ids = self._take(lease_id, keys)
        return taken, block_ids, self.nixl.sums(block_ids) if block_ids else []

    async def _release(self, lease_id: str, reason: str) -> None:
        await self.loop.call(lambda engine: self.loop.leases.release(lease_id, reason))

    # the puller side
    async def pull(self, request: GenerateRequest, prompt: list[int]) -> PullReport:
        transfer = request.kv_transfer
        lease = transfer.lease
        report = PullReport(lease_id=lease.id)
        if transfer.lease_problem is not None:  # an address this engine cannot use
            report.recomputed, report.reason = True, "bad_lease"
            log.warning("request %s: the lease cannot be pulled (%s): the prompt is recomputed",
                        request.request_id, transfer.lease_problem)
            self._count(report)
            return report
        try:
            return await self._pull(request, prompt, report)
        except asyncio.CancelledError:  # aborted, or the client went away: the source must not wait for the TTL
            task = asyncio.get_running_loop().create_task(
                release_remote(address_of(lease), lease.id, reason="aborted", timeout_s=self.timeout_s))
            self._releases.add(task)  # (a release after the hang-up released it already is a no-op)
            task.add_done_callback(self._releases.discard)
            raise

    async def _pull(self, request: GenerateRequest, prompt: list[int], report: PullReport) -> PullReport:
        lease = request.kv_transfer.lease
        keys, present = await self.loop.call(lambda engine: self._wanted(engine, request, prompt))
        ask = keys[present:]
        if not ask:  # nothing a prefix hit could use, or all of it cached here already
            await release_remote(address_of(lease), lease.id, reason="nothing to pull",
                                 timeout_s=self.timeout_s)
            self._count(report)
            return report
        address = address_of(lease)
        via = channel_for(address, self.backend)
        slots = self.nixl.reserve(len(ask)) if via == "nixl" else None
        if via == "nixl" and slots is None:  # the landing area is full of other pulls: this one goes another way
            via = channel_for(address, "shm")
        nbytes, corrupt = 0, False
        try:
            started = time.monotonic()
            async with Pull(address, lease.id, timeout_s=self.timeout_s, via=via) as transfer:
                report.via = transfer.via
                if slots is not None:
                    blocks, corrupt = await self._pushed(transfer, ask, slots)
                    self.nixl.give_back(slots, failed=False)  # copied out: free for the next pull
                    slots = None
                    nbytes = len(blocks) * self.nixl.layout.num_layers * 2 * self.nixl.layout.half_bytes
                else:
                    payloads = await transfer.fetch([key.hex() for key in ask])
                    nbytes = sum(len(p) for p in payloads)
                    blocks = await asyncio.to_thread(lambda: [b for data in payloads for b in decode(data)])
                self.metrics.kv_transfer_blocks.labels(direction="received").inc(len(blocks))
                installed, run, room = await self.loop.call(lambda engine: self._install(engine, blocks, keys))
                report.blocks_pulled = installed
                if run < len(keys):
                    report.recomputed = True
                    report.reason = "payload" if corrupt else "not_leased" if len(blocks) < len(ask) else \
                        "no_room" if installed == room < len(blocks) else "mismatch"
                try:  # what is installed stays (its keys are checked): a failed goodbye is the source's TTL to mend
                    await transfer.done(reason=report.reason and f"{installed} of {len(ask)} blocks installed")
                except TransferError as error:
                    log.warning("lease %s: the source did not hear that the pull is done: %s", lease.id, error)
        except TransferError as error:
            report.recomputed, report.reason = True, error.code
            detail = str(error)
        except PayloadError as error:
            report.recomputed, report.reason = True, "payload"
            detail = str(error)
        else:
            detail = f"{report.blocks_pulled} of {len(ask)} blocks installed"  # (a mismatch: import_blocks logged which)
        finally:
            if slots is not None:  # the pull ended before its blocks were copied out: a write may still land there
                self.nixl.give_back(slots, failed=True)
        if not report.recomputed:
            log.info("request %s: pulled %d KV blocks (%d bytes) under lease %s via %s in %.1f ms",
                     request.request_id, report.blocks_pulled, nbytes, lease.id, report.via,
                     (time.monotonic() - started) * 1000.0)
        else:
            log.warning("request %s: KV pull under lease %s from %s recomputes %d of %d blocks (%s): %s",
                        request.request_id, lease.id, lease.transport.tcp,
                        len(ask) - report.blocks_pulled, len(ask), report.reason, detail)
        self._count(report)
        return report

    async def _pushed(self, transfer: Pull, ask: list[bytes], slots: list[int]) -> tuple[list[KVBlock], bool]:
        """A pull over NIXL into `slots`: the blocks whose sums are the source's, and whether one was not (the rest
        from it on are dropped: recomputed)."""
        async with self.nixl.progressing():
            written, sums = await transfer.push([key.hex() for key in ask], self.nixl.target(slots))
        keys = [bytes.fromhex(key) for key in written]
        blocks, bad = await self.loop.call(lambda engine: self.nixl.received(slots, keys, sums))
        if bad is not None:
            log.warning("lease %s: block %d of %d arrived over NIXL with a sum that is not the source's: it and the "
                        "rest are recomputed", transfer.lease_id, bad, len(written))
        return blocks, bad is not None

    def _wanted(self, engine: LLMEngine, request: GenerateRequest, prompt: list[int]) -> tuple[list[bytes], int]:
        """Engine thread: this engine's keys of the blocks a prefix hit can use (all but the last token's), and how
        many of them, from the first, it holds already (its pool or its host tier: those are not pulled)."""
        if engine.workers is not None or request.sampling.prompt_logprobs is not None:
            return [], 0  # KV cannot move into a tensor-parallel pool; prompt logprobs recompute the prompt anyway
        adapter = request.adapter.digest if request.adapter else None
        keys = engine.kv_keys(prompt, adapter=adapter, tenant=request.tenant)
        keys = keys[: (len(prompt) - 1) // engine.block_manager.block_size]
        return keys, held_run(engine.block_manager, engine.host_tier, keys)

    @staticmethod
    def _install(engine: LLMEngine, blocks: list[KVBlock], keys: list[bytes]) -> tuple[int, int, int]:
        """Engine thread: import the blocks (each re-checked against this engine's key for its place); how many
        went in, how many of keys, from the first, it now holds (held_run), and how many free pages there were."""
        room = engine.block_manager.num_free_blocks
        installed = engine.import_blocks(blocks, keys) if blocks else 0
        return installed, held_run(engine.block_manager, engine.host_tier, keys), room

    def _count(self, report: PullReport) -> None:
        outcome = "recomputed" if report.recomputed else "ok"
        self.metrics.kv_pulls.labels(outcome=outcome, via=report.via or "none").inc()
        if report.recomputed:
            self.metrics.kv_recomputes.labels(reason=report.reason).inc()

    def abort(self, request_id: str) -> bool:
        """POST /v1/abort during a pull: stop it (the lease is released by the hang-up); the request then ends as
        aborted. False when no pull is under way for it."""
        pending = self.pending.get(request_id)
        if pending is None:
            return False
        pending.aborted = True
        pending.task.cancel()
        return True

