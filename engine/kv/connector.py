"""The seam for KV that lives outside the device page pool: a host tier, another engine.

A connector has two sides. The scheduler side (no torch) answers which of a waiting sequence's block keys
it can supply, is told which pages to fill for them, reports loads that finished, and hears of every
cached block about to leave the pool (its chance to save it). The worker side moves the bytes between
the pool's pages and wherever the connector keeps them, never blocking a step: a load runs on a side
stream (CUDA) or a thread (CPU), and the sequence waits in the scheduler until its blocks are in.

Keys are engine/block_keys.py's: the scheduler asks with the keys it computed itself, and a connector returns
blocks only under exactly those keys. Loaded blocks become ordinary cached prefix blocks
(BlockManager.install), so the sequence then runs as a prefix-cache hit: what is computed and sampled is
what a colocated run computes and samples.

Per step, the engine drives it as:
  schedule():   for each loading sequence whose load finished -> install (or release, if it failed);
                for a waiting sequence: device hits = lookup_prefix; n = connector.lookup(keys after them);
                n > 0 -> take n pages, connector.start_load(...), the sequence waits (others go on)
  eviction:     BlockManager.on_evict(block id, key) -> connector.save(...) before the page is reused
"""

from dataclasses import dataclass
from typing import Protocol


@dataclass
class Load:
    """Blocks on their way into pages for one sequence."""

    seq_id: int
    keys: list[bytes]
    block_ids: list[int]
    ok: bool = True  # False: the bytes could not be had (the pages are released, the sequence recomputes)


class ConnectorScheduler(Protocol):
    """Decisions, in plain Python over keys and page ids."""

    def lookup(self, keys: list[bytes]) -> int:
        """How many of keys, from the first, this connector can load."""

    def start_load(self, load: Load) -> None:
        """Begin filling load.block_ids (held by the caller) with the blocks of load.keys."""

    def finished_loads(self) -> list[Load]:
        """Loads done since the last call (ok or not); the caller installs or releases their pages."""

    def save(self, block_id: int, key: bytes) -> None:
        """A cached block is about to leave the pool: keep its bytes if worth it, before the page is reused."""


class ConnectorWorker(Protocol):
    """Moving bytes between pages and the connector's storage (torch)."""

    def read(self, block_ids: list[int]) -> object:
        """The pages' bytes, copied out (engine.kv.payload.read_pages)."""

    def write(self, block_ids: list[int], data: object) -> None:
        """Bytes into pages no sequence reads yet (engine.kv.payload.write_pages)."""
