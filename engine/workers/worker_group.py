"""Rank 0's handle on the tensor-parallel workers: spawns them, sends each step's model input (and the adapter
copies since the last step) before rank 0's own forward pass, notices a worker that dies, stops them all. It is
the adapter pool's Mirror: each worker gets its shard of an adapter from rank 0's one read of it, so no rank
reads the adapter's files again (they may be gone, or replaced, by then)."""

import dataclasses
import multiprocessing
import multiprocessing.connection
import pickle
import threading
import time
import weakref

import torch

import adapters
from engine.context import Context
from engine.parallel.communicator import COLLECTIVE_TIMEOUT_S, Communicator, free_port
from engine.parallel.sharding import shard_adapter
from engine.workers.step_plan import AdapterCopy, encode
from engine.workers.worker import WorkerSpec, worker_main

START_TIMEOUT_S = 600.0  # loading a shard of a large checkpoint
GRACE_S = 2.0  # after a failed collective, how long to wait for a dying worker to show it


class RankFailed(RuntimeError):
    """A tensor-parallel worker died or failed: the engine cannot run another step."""


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:(i + r) for the engine's cuda:i, cpu for cpu."""
    if not device.startswith("cuda"):
        return device
    index = int(device.partition(":")[2] or 0)
    return f"cuda:{index + rank}"


class WorkerGroup:
    def __init__(self, *, model: str, dtype: str, device: str, size: int, block_size: int,
                 quantization: str | None = None, kv_cache_dtype: str = "auto",
                 timed: bool = False, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        self.size = size
        self.device = torch.device(device)
        self.port = free_port()
        self.timeout_s = timeout_s
        context = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.Process] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        for rank in range(1, size):
            spec = WorkerSpec(model=model, dtype=dtype, device=rank_device(device, rank), rank=rank, size=size,
                              port=self.port, block_size=block_size, quantization=quantization,
                              kv_cache_dtype=kv_cache_dtype,
                              num_threads=torch.get_num_threads(), timeout_s=timeout_s, timed=timed)
            parent, child = context.Pipe()
            process = context.Process(target=worker_main, args=(spec, child), name=f"quilt-tp-rank{rank}",
                                      daemon=True)
            process.start()
            child.close()
            self.processes.append(process)
            self.conns.append(parent)
        self._lock = threading.Lock()  # one message at a time on each pipe, whichever thread sends
        self._copies: list[AdapterCopy] = []
        self._failure: str | None = None
        self._stopping = False
        self.broadcast_seconds = 0.0
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.conns)
        threading.Thread(target=_watch, args=(weakref.ref(self), [p.sentinel for p in self.processes]),
                         name="tensor-parallel-watch", daemon=True).start()

    # start-up
    def connect(self, comm: Communicator) -> list[int]:
        """Wait for every worker's shard, then join the process group; returns each worker's free device
        memory (bytes, 0 on CPU) after its weights."""
        free = [self._expect(i, "loaded", START_TIMEOUT_S)[1] for i in range(len(self.conns))]
        comm.connect(port=self.port, device=self.device, timeout_s=self.timeout_s)
        return free

    def start(self, model: torch.nn.Module, num_pages: int) -> None:
        """Give every worker the pool's size (the same page ids on every rank) and wait until it is ready; from
        then on every forward pass of rank 0's model runs on every rank."""
        model.register_forward_pre_hook(self.before_forward)
        for conn in self.conns:
            conn.send(("memory", num_pages))
        for i in range(len(self.conns)):
            self._expect(i, "ready", START_TIMEOUT_S)

    def _expect(self, index: int, kind: str, timeout_s: float) -> tuple:
        conn, process = self.conns[index], self.processes[index]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready = multiprocessing.connection.wait([conn, process.sentinel], timeout=1.0)
            if conn in ready:
                try:
                    message = conn.recv()
                except EOFError:
                    raise self._fail(self._describe(index)) from None
                if message[0] == "error":
                    raise self._fail(f"tensor-parallel rank {index + 1} failed: {message[1]}")
                if message[0] == kind:
                    return message
            elif ready:
                raise self._fail(self._describe(index))
        raise self._fail(f"tensor-parallel rank {index + 1} sent no {kind!r} within {timeout_s:.0f} s")

    # adapters (the pool's Mirror)
    def pack(self, adapter: "adapters.LoadedAdapter") -> list[bytes]:
        """Each worker's shard of an adapter rank 0 read, serialized (any thread: the pool's loader)."""
        shards = []
        for rank in range(1, self.size):
            shard = shard_adapter(adapter, rank=rank, size=self.size)
            # cloned: a pickled slice would carry its whole storage; once per tensor, as slices that share one A
            # (a fused-name module's) must share it on every rank for its rows to be packed once there too
            clones: dict[int, torch.Tensor] = {}
            for t in shard.tensors.values():
                if id(t) not in clones:
                    clones[id(t)] = t.clone()
            tensors = {name: clones[id(t)] for name, t in shard.tensors.items()}
            shards.append(pickle.dumps(dataclasses.replace(shard, tensors=tensors), protocol=5))
        return shards

    def hold(self, digest: str, packed: list[bytes]) -> None:
        """The adapter entered rank 0's host tier: each worker keeps its shard until `drop`."""
        if self._failure is None:
            with self._lock:
                for index, conn in enumerate(self.conns):
                    self._send_one(index, conn, ("hold", digest, packed[index]))

    def drop(self, digest: str) -> None:
        if self._failure is None:
            self._send(("drop", digest))

    def place(self, digest: str, pages: list[int]) -> None:
        """Rank 0 placed an adapter in `pages`: every worker copies its shard there before the next step."""
        self._copies.append(AdapterCopy(digest=digest, pages=list(pages)))

    # each step

    def before_forward(self, module, args: tuple[torch.Tensor, Context]) -> None:
        """Forward pre-hook of rank 0's model: every worker gets the same input before rank 0 computes."""
        input_ids, ctx = args
        self.check()
        start = time.perf_counter()
        data = encode(input_ids, ctx, self._copies)
        self._copies = []
        self._send(("step", data))
        self.broadcast_seconds += time.perf_counter() - start

    def _send(self, message: tuple) -> None:
        with self._lock:
            for index, conn in enumerate(self.conns):
                self._send_one(index, conn, message)

    def _send_one(self, index: int, conn, message: tuple) -> None:
        try:
            conn.send(message)
        except OSError:
            raise self._fail(self._describe(index)) from None

    # failures
    def failure(self) -> str | None:
        """Why the group cannot run another step (a worker died or failed), or None. Any thread: a watcher
        thread records a worker's death the moment it happens, even while a step is blocked in a collective."""
        return self._failure

    def check(self) -> None:
        if self._failure is None:
            for index, process in enumerate(self.processes):
                if not process.is_alive():
                    self._fail(self._describe(index))
        if self._failure is not None:
            raise RankFailed(self._failure)

    def failed(self, error: BaseException) -> RankFailed:
        """The RankFailed to raise for an exception out of a step: names the worker that died or failed if one
        did (waiting briefly for it to show), else the collective's own error."""
        if self._failure is not None:
            return RankFailed(self._failure)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            for index, conn in enumerate(self.conns):
                if conn.poll():
                    try:
                        message = conn.recv()
                    except EOFError:
                        continue
                    if message[0] == "error":
                        return self._fail(f"tensor-parallel rank {index + 1} failed: {message[1]}")
            if self._failure is not None:
                return RankFailed(self._failure)
            time.sleep(0.05)
        return self._fail(f"tensor-parallel step failed: {type(error).__name__}: {error}")

    def _describe(self, index: int) -> str:
        process = self.processes[index]
        process.join(timeout=GRACE_S)
        code = process.exitcode
        how = "is not responding" if code is None else \
            f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"tensor-parallel rank {index + 1} (pid {process.pid}) {how}; the engine cannot run further steps"

    def _fail(self, message: str) -> RankFailed:
        self._failure = self._failure or message
        return RankFailed(self._failure)

    # measurement and shutdown
    def stats(self) -> list[dict]:
        """Per worker: steps, seconds in steps, seconds in collectives (timed groups only)."""
        self._send(("stats",))
        return [self._expect(i, "stats", 60.0)[1] for i in range(len(self.conns))]

    def probe(self, comm: Communicator, shape: tuple[int, ...], dtype: torch.dtype, count: int) -> float:
        """Mean seconds of one all-reduce of `shape` run back to back on every rank, nothing else running: the
        collective's own cost, without waiting for a slower rank (benchmarks)."""
        self._send(("probe", tuple(shape), count))
        x = torch.zeros(shape, dtype=dtype, device=self.device)
        comm.all_reduce(x)  # the first one also waits for every worker to get here
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        for _ in range(count - 1):
            comm.all_reduce(x)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        return (time.perf_counter() - start) / max(count - 1, 1)

    def stop(self) -> None:
        """Stop every worker (asking first, then terminating); idempotent."""
        self._stopping = True
        self._finalizer()


def _watch(group_ref: "weakref.ref[WorkerGroup]", sentinels: list[int]) -> None:
    ready = multiprocessing.connection.wait(sentinels)
    group = group_ref()
    if group is not None and not group._stopping:
        group._fail(group._describe(sentinels.index(ready[0])))


def _stop(processes: list[multiprocessing.Process], conns: list) -> None:
    for conn in conns:
        try:
            conn.send(("stop",))
        except OSError:
            pass
    deadline = time.monotonic() + 5.0
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(timeout=5.0)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in conns:
        conn.close()
