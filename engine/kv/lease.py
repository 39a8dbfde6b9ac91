"""Leases: the source engine's promise to keep a prompt's full KV blocks for another engine to pull.

A lease holds the cached blocks of a prompt's leading run of keys (BlockManager.hold: they cannot be evicted or
reused while held) under a random id, for a TTL. It ends exactly once, by one of: the puller's `done` (or its
giving up), its connection closing before that, the TTL passing, the engine draining, newer leases needing
the room (leases hold at most half the pool, the ones closest to expiry giving way), or the scheduler needing the
pages for a request (`reclaim`: a puller that has not come must not hold up this engine's own work). Ending a lease drops the
holds: the blocks become ordinary prefix-cache blocks again, evictable once no sequence uses them. A lease is
pulled at most once. Engine thread only (the block manager's); no torch.
"""

import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.kv.transport import LeaseRefused

RELEASE_REASONS = ("done", "released", "closed", "expired", "drain", "evicted", "needed")
MAX_HELD_FRACTION = 0.5  # of the pool's pages that leases may hold together: the rest stays for running requests


@dataclass
class Lease:
    id: str
    keys: list[bytes]  # of the held blocks, in chain order
    block_ids: list[int]
    num_tokens: int  # tokens the held blocks cover
    expires_at: float  # on the table's clock
    pulled: bool = False
    request_id: str | None = None  # the prefill hop that computed the blocks: its abort ends the lease


class LeaseTable:
    def __init__(self, block_manager: BlockManager, *, clock: Callable[[], float] = time.monotonic,
                 max_leases: int = 1024, max_held_fraction: float = MAX_HELD_FRACTION) -> None:
        self.block_manager = block_manager
        self.clock = clock
        self.max_leases = max_leases
        self.max_held_blocks = int(block_manager.num_blocks * max_held_fraction)
        self.leases: dict[str, Lease] = {}
        self.num_granted = 0
        self.num_released: Counter[str] = Counter()  # reason -> leases ended so
        self.num_blocks_sent = 0

    @property
    def num_held_blocks(self) -> int:
        return sum(len(lease.block_ids) for lease in self.leases.values())

    def grant(self, keys: list[bytes], *, ttl_s: float, request_id: str | None = None) -> Lease:
        """Hold the cached blocks of the leading run of keys; the lease may hold fewer than asked (none, even)."""
        if ttl_s <= 0:
            raise ValueError("a lease's TTL must be > 0")
        block_ids = self.block_manager.hold(keys)
        lease = Lease(id=secrets.token_hex(16), keys=list(keys[: len(block_ids)]), block_ids=block_ids,
                      num_tokens=len(block_ids) * self.block_manager.block_size, expires_at=self.clock() + ttl_s,
                      request_id=request_id)
        # pullers that never come must not pin the pool: past the caps, the leases closest to expiry end first
        while self.leases and (len(self.leases) >= self.max_leases
                               or self.num_held_blocks + len(block_ids) > self.max_held_blocks):
            self.release(min(self.leases.values(), key=lambda held: held.expires_at).id, "evicted")
        if len(block_ids) > self.max_held_blocks:  # alone past the cap: a lease of what fits
            self.block_manager.release(block_ids[self.max_held_blocks :])
            del lease.block_ids[self.max_held_blocks :], lease.keys[self.max_held_blocks :]
            lease.num_tokens = len(lease.block_ids) * self.block_manager.block_size
        self.leases[lease.id] = lease
        self.num_granted += 1
        return lease

    def take(self, lease_id: str, keys: list[bytes]) -> list[bytes]:
        """The keys of the lease's blocks the puller asked for: its leading run of asked keys that the lease holds,
        in the asked order. A lease is taken once; an unknown, expired or taken one is refused."""
        lease = self.leases.get(lease_id)
        if lease is None:
            raise LeaseRefused(f"no lease {lease_id} here: unknown, expired or released")
        if self.clock() >= lease.expires_at:
            self.release(lease_id, "expired")
            raise LeaseRefused(f"lease {lease_id} expired", code="expired")
        if lease.pulled:
            raise LeaseRefused(f"lease {lease_id} was pulled already", code="pulled")
        lease.pulled = True
        held = set(lease.keys)
        taken = []
        for key in keys:
            if key not in held:
                break
            taken.append(key)
        self.num_blocks_sent += len(taken)
        return taken

    def release(self, lease_id: str, reason: str) -> bool:
        """End a lease (its blocks back to the prefix cache); False when it had ended already."""
        assert reason in RELEASE_REASONS, reason
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        self.block_manager.release(lease.block_ids)
        self.num_released[reason] += 1
        return True

    def release_request(self, request_id: str) -> bool:
        """End the lease a prefill hop's request granted and nobody has pulled yet (its caller went away as it was
        granted); False when there is none."""
        lease = next((held for held in self.leases.values() if held.request_id == request_id and not held.pulled), None)
        return lease is not None and self.release(lease.id, "released")

    def reclaim(self, num_pages: int) -> int:
        """End leases, those closest to expiry first, until `num_pages` pages are free that were not (a block a
        running sequence shares frees nothing); the pages freed. The scheduler asks when admission or a running
        sequence lacks pages (engine.scheduler)."""
        before = self.block_manager.num_free_blocks
        while self.leases and self.block_manager.num_free_blocks - before < num_pages:
            self.release(min(self.leases.values(), key=lambda held: held.expires_at).id, "needed")
        return self.block_manager.num_free_blocks - before

    def expire(self) -> list[str]:
        """Release the leases whose TTL has passed; their ids."""
        now = self.clock()
        ended = [lease.id for lease in self.leases.values() if now >= lease.expires_at]
        for lease_id in ended:
            self.release(lease_id, "expired")
        return ended

    def release_all(self, reason: str = "drain") -> int:
        ids = list(self.leases)
        for lease_id in ids:
            self.release(lease_id, reason)
        return len(ids)

    def state(self) -> dict:
        return {"active": len(self.leases), "held_blocks": self.num_held_blocks, "granted": self.num_granted,
                "released": dict(self.num_released), "blocks_sent": self.num_blocks_sent}
