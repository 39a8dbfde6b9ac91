"""Adapters in three tiers: GPU slots, a host-memory LRU cache bounded in bytes, the store on disk.

A request for an adapter that is in neither memory tier triggers a load by a background thread
while the request waits in the queue; the scheduler asks `ready()`. Loads that fail are reported
by `failures()` so that only the requests for that adapter fail. Slots are filled by
`activate()` before a step, evicting the least-recently-used adapter that no running request uses.
"""

import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import adapters
from engine.lora_linear import LoRAWeights

CANONICAL_SIDECAR = "quilt_adapter.json"


def read_adapter(path: str | Path, base_config: dict, max_rank: int) -> "adapters.LoadedAdapter":
    """The disk tier: Quilt's canonical folder on the fast path, anything PEFT wrote otherwise."""
    path = Path(path)
    if (path / CANONICAL_SIDECAR).exists():
        return adapters.load_canonical(path)
    return adapters.load_adapter(path, base_config, max_rank=max_rank)


class AdapterPool:
    def __init__(
        self,
        *,
        weights: dict[tuple[int, str], tuple[LoRAWeights, int]],
        num_slots: int,
        max_rank: int,
        host_cache_bytes: int,
        load: Callable[[str | Path], "adapters.LoadedAdapter"],
    ) -> None:
        self.weights = weights  # (layer, module) -> (stacked weights, slice index)
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.host_cache_bytes = host_cache_bytes
        self.load = load
        self.paths: dict[str, Path] = {}  # digest -> where it is stored
        self.host: OrderedDict[str, adapters.LoadedAdapter] = OrderedDict()  # LRU first
        self.slots: OrderedDict[str, int] = OrderedDict()  # digest -> slot, LRU first
        self.free_slots = list(range(num_slots))
        self.loading: set[str] = set()
        self.failed: dict[str, str] = {}
        self._requests: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._worker, name="adapter-loader", daemon=True)
        self._thread.start()

    def register(self, digest: str, path: str | Path) -> None:
        self.paths[digest] = Path(path)
        self.failed.pop(digest, None)

    def add_loaded(self, adapter: "adapters.LoadedAdapter", path: str | Path) -> None:
        """Register an adapter already read (the offline API reads it to learn its digest)."""
        self.register(adapter.digest, path)
        self._check(adapter)
        self._put_host(adapter)

    def is_registered(self, digest: str) -> bool:
        return digest in self.paths

    # tiers
    def ready(self, digest: str) -> bool:
        """Whether the adapter is in memory (slot or host); if not, make sure it is being loaded."""
        self._drain()
        if digest in self.slots or digest in self.host:
            return True
        if digest not in self.failed and digest not in self.loading:
            self.loading.add(digest)
            self._requests.put((digest, self.paths[digest]))
        return False

    def failures(self) -> dict[str, str]:
        """digest -> reason for every adapter whose load failed (until it is registered again)."""
        self._drain()
        return self.failed

    def activate(self, needed: set[str], in_use: set[str]) -> dict[str, int]:
        """Put every needed adapter in a GPU slot; returns digest -> slot for them."""
        assert len(needed) <= self.num_slots
        for digest in needed:
            if digest in self.slots:
                self.slots.move_to_end(digest)
                continue
            if self.free_slots:
                slot = self.free_slots.pop()
            else:
                victim = next(d for d in self.slots if d not in in_use and d not in needed)
                slot = self.slots.pop(victim)
            adapter = self.host.get(digest)
            if adapter is None:  # pushed out of the host cache since ready() said yes
                adapter = self.load(self.paths[digest])
                self._put_host(adapter)
            self._write_slot(slot, adapter)
            self.slots[digest] = slot
            self.host.move_to_end(digest)
        return {digest: self.slots[digest] for digest in needed}

    def _write_slot(self, slot: int, adapter: "adapters.LoadedAdapter") -> None:
        touched = {id(w): w for w, _ in self.weights.values()}
        for w in touched.values():
            w.lora_a[:, slot].zero_()
            w.lora_b[slot].zero_()
            w.scaling[:, slot] = 0.0
            w.ranks[slot] = 0
            w.host_ranks[slot] = 0
        for key, rank in adapter.ranks.items():
            _, layer, module = key.split(".")
            w, s = self.weights[(int(layer), module)]
            o0, o1 = w.slice_offsets[s], w.slice_offsets[s + 1]
            w.lora_a[s, slot, :rank].copy_(adapter.tensors[f"{key}.lora_A"])
            w.lora_b[slot, o0:o1, :rank].copy_(adapter.tensors[f"{key}.lora_B"])
            w.scaling[s, slot] = adapter.scaling[key]
            w.host_ranks[slot] = max(w.host_ranks[slot], rank)
            w.ranks[slot] = w.host_ranks[slot]

    def _check(self, adapter: "adapters.LoadedAdapter") -> None:
        if adapter.rank > self.max_rank:
            raise adapters.AdapterError(
                "rank_too_large", f"adapter rank {adapter.rank} exceeds this engine's max_adapter_rank {self.max_rank}"
            )
        for key in adapter.ranks:
            _, layer, module = key.split(".")
            if (int(layer), module) not in self.weights:
                raise adapters.AdapterError("module_unsupported", f"adapter targets {key}, which this model lacks")

    def _put_host(self, adapter: "adapters.LoadedAdapter") -> None:
        self.host[adapter.digest] = adapter
        self.host.move_to_end(adapter.digest)
        used = sum(a.num_bytes for a in self.host.values())
        for digest in list(self.host):
            if used <= self.host_cache_bytes:
                break
            if digest == adapter.digest:
                continue
            used -= self.host.pop(digest).num_bytes

    # loading
    def _worker(self) -> None:
        while True:
            digest, path = self._requests.get()
            try:
                adapter = self.load(path)
                if adapter.digest != digest:
                    raise adapters.AdapterError(
                        "digest_mismatch", f"adapter at {path} has digest {adapter.digest}, registered as {digest}"
                    )
                self._check(adapter)
                self._results.put((digest, adapter, None))
            except (adapters.AdapterError, OSError) as exc:
                self._results.put((digest, None, str(exc)))

    def _drain(self) -> None:
        while True:
            try:
                digest, adapter, error = self._results.get_nowait()
            except queue.Empty:
                return
            self.loading.discard(digest)
            if error is not None:
                self.failed[digest] = error
            else:
                self._put_host(adapter)

    def state(self) -> dict:
        return {
            "gpu_slots": self.num_slots,
            "gpu": list(self.slots),
            "host": list(self.host),
            "host_bytes": sum(a.num_bytes for a in self.host.values()),
            "loading": sorted(self.loading),
            "failed": dict(self.failed),
            "registered": len(self.paths),
        }

