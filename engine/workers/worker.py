"""A tensor-parallel worker (ranks 1..N-1): a spawned process that builds its model stack as rank 0 does
(engine/rank_model.py: its shard of the model, its own page memory with the same page ids as rank 0 and its
share of the KV heads), and then, for every step rank 0 sends, copies its shard of any adapter rank 0 placed
into the same pages and runs the same forward pass. It never samples.

Messages from rank 0 (a Pipe): ("memory", num_pages), ("hold", digest, shard bytes), ("drop", digest),
("step", bytes), ("probe", shape, count), ("stats",), ("stop",). To rank 0: ("loaded", free_bytes), ("ready",),
("stats", dict), ("error", text).
"""

import pickle
import queue
import threading
import time
from dataclasses import dataclass

import torch

import adapters
from engine.adapter_plan import AdapterPlan
from engine.lora_modules import row_widths
from engine.models import read_hf_config
from engine.paged_memory import PagedMemory
from engine.parallel.communicator import Communicator
from engine.rank_model import attach_pages, load_rank_model
from engine.workers.step_plan import AdapterCopy, StepDecoder


@dataclass(frozen=True)
class WorkerSpec:
    model: str
    dtype: str
    device: str  # this rank's device
    rank: int
    size: int
    port: int
    block_size: int
    quantization: str | None
    kv_cache_dtype: str
    num_threads: int
    timeout_s: float
    timed: bool = False  # add up the time spent in collectives (benchmarks)


class AdapterShards:
    """The worker's host copies of its shards of adapters, mirroring rank 0's host tier: rank 0 sends this rank's
    shard of an adapter from its own read when the adapter enters that tier ("hold") and says when it leaves it
    ("drop"); a background thread lays shards out (AdapterPlan) in the order they came, and `get` waits for it."""

    def __init__(self, *, hf_config: dict, size: int, num_layers: int, chunk: int, pin: bool) -> None:
        widths = row_widths(adapters.BaseShapes.from_config(hf_config), tensor_parallel_size=size)
        self._plan = lambda shard: AdapterPlan.build(shard, num_layers=num_layers, widths=widths, chunk=chunk,
                                                     pin=pin)
        self._plans: dict[str, AdapterPlan | BaseException] = {}
        self._received = self._applied = 0  # messages, so that `get` sees every one sent before the step
        self._done = threading.Condition()
        self._pending: queue.Queue = queue.Queue()
        threading.Thread(target=self._loader, name="adapter-shard-loader", daemon=True).start()

    def hold(self, digest: str, data: bytes) -> None:
        self._received += 1
        self._pending.put((digest, data))

    def drop(self, digest: str) -> None:
        self._received += 1
        self._pending.put((digest, None))

    def get(self, digest: str) -> AdapterPlan:
        received = self._received
        with self._done:
            self._done.wait_for(lambda: self._applied >= received)
            plan = self._plans.get(digest)
        if plan is None:  # a bug: rank 0 places only what it holds, and sent it before the step
            raise RuntimeError(f"rank 0 placed adapter {digest[:12]}, which this rank does not hold")
        if isinstance(plan, BaseException):
            raise RuntimeError(f"this rank's shard of adapter {digest[:12]} does not fit: {plan}") from plan
        return plan

    def _loader(self) -> None:
        while True:
            digest, data = self._pending.get()
            plan = None
            if data is not None:
                try:
                    plan = self._plan(pickle.loads(data))
                except Exception as error:  # reported when rank 0 places it, the only time it matters
                    plan = error
            with self._done:
                if plan is None:
                    self._plans.pop(digest, None)
                else:
                    self._plans[digest] = plan
                self._applied += 1
                self._done.notify_all()


def write_adapter(memory: PagedMemory, plan: AdapterPlan, pages: list[int]) -> None:
    """Copy the plan's chunks into `pages` of every layer (what AdapterPool does on rank 0)."""
    device = memory.layers[0].device
    ids = plan.chunk_ids(pages, chunk=memory.chunk, chunk_start=memory.chunk_start).to(device)
    for layer in range(plan.chunks.shape[0]):
        target = memory.layers[layer].view(-1, memory.chunk)  # [2 * (num_pages + 1), chunk]
        target.index_copy_(0, ids, plan.chunks[layer].to(device=device, dtype=target.dtype))


def worker_main(spec: WorkerSpec, conn) -> None:
    try:
        _serve(spec, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # rank 0 is gone: nothing to report to
    except Exception as error:  # a failed collective (a peer died) or a bug: rank 0 reports it
        try:
            conn.send(("error", f"{type(error).__name__}: {error}"))
        except OSError:
            pass
        raise SystemExit(1) from None


def _serve(spec: WorkerSpec, conn) -> None:
    torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    comm = Communicator(rank=spec.rank, size=spec.size, timed=spec.timed)
    model = load_rank_model(spec.model, dtype=getattr(torch, spec.dtype), device=device, comm=comm,
                            quantization=spec.quantization)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    conn.send(("loaded", free))
    comm.connect(port=spec.port, device=device, timeout_s=spec.timeout_s)
    kind, num_pages = conn.recv()
    assert kind == "memory", kind
    memory = attach_pages(model, num_pages=num_pages, block_size=spec.block_size,
                          kv_cache_dtype=spec.kv_cache_dtype, device=device)
    args = model.spec
    shards = AdapterShards(hf_config=read_hf_config(spec.model), size=spec.size, num_layers=args.num_layers,
                           chunk=memory.chunk, pin=device.type == "cuda")
    moe = getattr(args, "moe", None)
    decoder = StepDecoder(device, num_layers=args.num_layers, zero_row=memory.zero_row,
                          num_experts=moe.num_experts if moe else 0)
    conn.send(("ready",))
    stats = {"steps": 0, "step_seconds": 0.0}
    while True:
        message = conn.recv()
        if message[0] == "stop":
            comm.close()
            return
        if message[0] == "hold":
            shards.hold(message[1], message[2])
        elif message[0] == "drop":
            shards.drop(message[1])
        elif message[0] == "probe":  # rank 0 times bare all-reduces of this shape (benchmarks)
            _, shape, count = message
            x = torch.zeros(shape, dtype=model.lm_head.weight.dtype, device=device)
            for _ in range(count):
                comm.all_reduce(x)
        elif message[0] == "stats":
            conn.send(("stats", {**stats, "comm_seconds": comm.seconds, "comm_calls": comm.calls}))
        elif message[0] == "step":
            start = time.perf_counter()
            copies, input_ids, ctx = decoder.decode(message[1])
            _copy_adapters(memory, shards, copies)
            with torch.inference_mode():
                model(input_ids, ctx)
            if device.type == "cuda" and spec.timed:
                torch.cuda.synchronize(device)
            stats["steps"] += 1
            stats["step_seconds"] += time.perf_counter() - start


def _copy_adapters(memory: PagedMemory, shards: AdapterShards, copies: list[AdapterCopy]) -> None:
    for copy in copies:
        write_adapter(memory, shards.get(copy.digest), copy.pages)
