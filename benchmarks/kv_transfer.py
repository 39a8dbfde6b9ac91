"""KV blocks between two engine processes' page pools: NIXL against TCP and shared memory, side by side.

    .venv/bin/python -m benchmarks.kv_transfer [--shape tiny|llama-8b|llama-8b-2k] [--requests 8] [--runs 3]
    .venv/bin/python -m benchmarks.kv_transfer --device cuda --shape llama-8b-2k --vias nixl   # the GPU suite's kv step

A source process holds a page pool of the shape (random KV) behind engine/kv/transport.py's TransferServer; this
process holds another pool and pulls one request's blocks at a time, each under its own lease, as a decode hop does:

    tcp, shm   the source copies the pages out and encodes them (engine/kv/payload.py); the puller decodes them
               (checksum, layout) and writes them into its pages
    nixl       the source writes its pages into the puller's registered landing slots (engine/kv/nixl.py); the
               puller copies the slots out, checks each block's sum and writes them into its pages

Timed per request: from the pull's start until the blocks are in the puller's pages (what a decode hop waits for),
without the engine's steps. Within a run the channels alternate request by request; each run prints per channel the
p50 and p99 per-request time, GB/s at the p50 (the blocks' KV bytes over that time) and the ratio to TCP's p50; the
last table is each channel's p50 over the runs (min-max: the spread). UCX picks its transports itself (shared memory,
CMA, TCP, cuda_ipc, cuda_copy); UCX_TLS=tcp measures NIXL over TCP alone, as between two hosts without RDMA.

    tiny         64 blocks of 8 KiB   (the test models: 2 layers, 1 KV head of 32, fp32, 16 tokens a block)
    llama-8b     32 blocks of 2 MiB   (Llama-3-8B in bfloat16: 32 layers, 8 KV heads of 128: a 512-token prompt)
    llama-8b-2k  128 blocks of 2 MiB  (a 2k-token Llama-3-8B prefill: 256 MiB a request)
"""

import argparse
import asyncio
import multiprocessing
import os
import statistics
import time

import torch

from engine.kv.nixl import NixlEndpoint, NixlError, nixl_available
from engine.kv.payload import KVBlock, KVLayout, decode, encode, read_pages, write_pages
from engine.kv.transport import LeaseRefused, Pull, TransferError, TransferServer, channel_for
from engine.paged_memory import PagedMemory

SHAPES = {  # name: (blocks a request, layers, KV heads, head dim, dtype)
    "tiny": (64, 2, 1, 32, torch.float32),
    "llama-8b": (32, 32, 8, 128, torch.bfloat16),
    "llama-8b-2k": (128, 32, 8, 128, torch.bfloat16),
}
BLOCK_SIZE = 16


def pool(shape: str, device: str, seed: int) -> PagedMemory:
    blocks, layers, heads, head_dim, dtype = SHAPES[shape]
    memory = PagedMemory(num_layers=layers, num_pages=blocks + 1, block_size=BLOCK_SIZE, kv_heads=heads,
                         head_dim=head_dim, dtype=dtype, device=torch.device(device))
    generator = torch.Generator(device=device).manual_seed(seed)
    for layer in memory.layers:
        layer.view(torch.uint8).copy_(torch.randint(0, 256, layer.view(torch.uint8).shape, generator=generator,
                                                    dtype=torch.uint8, device=device))
    return memory


def block_bytes(shape: str) -> int:
    _, layers, heads, head_dim, dtype = SHAPES[shape]
    return 2 * layers * BLOCK_SIZE * heads * head_dim * dtype.itemsize


def serve(shape: str, device: str, ready) -> None:
    """The source: every lease id is good once; each serves the whole pool's first `blocks` pages."""
    memory = pool(shape, device, seed=1)
    blocks = SHAPES[shape][0]
    pages = list(range(blocks))
    endpoint = NixlEndpoint(memory, name="bench-source", landing_blocks=1) if nixl_available() else None
    seen: set[str] = set()
    layout = KVLayout.of(memory)

    def take(lease_id: str) -> None:
        if lease_id in seen:
            raise LeaseRefused(f"lease {lease_id} was pulled already", code="pulled")
        seen.add(lease_id)

    async def payloads(lease_id: str, keys: list[str]) -> list[bytes]:
        take(lease_id)
        cuda = memory.layers[0].device.type == "cuda"
        kv, scales = read_pages(memory, pages, pin=cuda, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        found = [KVBlock(key=bytes.fromhex(key), layout=layout, kv=kv[i], scales=None) for i, key in enumerate(keys)]
        return await asyncio.to_thread(lambda: [encode([block]) for block in found])

    async def push(lease_id: str, keys: list[str], target: dict) -> dict:
        take(lease_id)
        sums = endpoint.sums(pages)
        try:
            local, remote = endpoint.descriptors(pages, target)
            await endpoint.write(local, remote, target, deadline_s=60)
        except NixlError as error:
            raise TransferError(str(error), code=error.code) from error
        return {"op": "blocks", "via": "nixl", "keys": keys, "sums": sums}

    async def release(lease_id: str, reason: str) -> None:
        pass

    async def main() -> None:
        server = await TransferServer(blocks=payloads, release=release, host="127.0.0.1",
                                      push=push if endpoint else None,
                                      nixl=endpoint.name if endpoint else None).start()
        ready.send(server.address)
        await asyncio.Event().wait()

    asyncio.run(main())


class Puller:
    def __init__(self, shape: str, device: str) -> None:
        self.memory = pool(shape, device, seed=2)
        self.blocks = SHAPES[shape][0]
        self.endpoint = NixlEndpoint(self.memory, name="bench-puller", landing_blocks=self.blocks) \
            if nixl_available() else None
        self.pages = list(range(self.blocks))
        self.cuda = device == "cuda"
        self.count = 0

    async def pull(self, address: dict, via: str) -> float:
        """One request's blocks into this pool's pages; the seconds it took."""
        self.count += 1
        keys = [f"{self.count:016x}{i:016x}" for i in range(self.blocks)]
        started = time.perf_counter()
        async with Pull(address, f"{self.count:032x}", timeout_s=120, via=via) as transfer:
            if via == "nixl":
                slots = self.endpoint.reserve(self.blocks)
                async with self.endpoint.progressing():
                    written, sums = await transfer.push(keys, self.endpoint.target(slots))
                blocks, bad = self.endpoint.received(slots, [bytes.fromhex(k) for k in written], sums)
                self.endpoint.give_back(slots, failed=False)
                assert bad is None and len(blocks) == self.blocks, bad
            else:
                payloads = await transfer.fetch(keys)
                blocks = await asyncio.to_thread(lambda: [b for data in payloads for b in decode(data)])
            kv = torch.stack([block.kv for block in blocks])
            write_pages(self.memory, self.pages, kv, None, non_blocking=self.cuda)
            if self.cuda:
                torch.cuda.synchronize()
            await transfer.done()
        return time.perf_counter() - started


async def run(address: dict, puller: Puller, vias: list[str], requests: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {via: [] for via in vias}
    for via in vias:  # a first pull each, untimed: the connection and UCX endpoints are made once per peer
        await puller.pull(address, via)
    for r in range(requests):
        for via in vias if r % 2 == 0 else reversed(vias):
            times[via].append(await puller.pull(address, via))
    return times


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="llama-8b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=8, help="timed requests per channel and run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--vias", default="nixl,tcp,shm", help="the channels, comma-separated")
    parser.add_argument("--goal-gbps", type=float, help="print whether nixl's slowest run reached this many GB/s")
    args = parser.parse_args()
    vias = args.vias.split(",")
    if "nixl" in vias and not nixl_available():
        raise SystemExit("nixl does not import here: pip install -r requirements/engine.txt")
    size = block_bytes(args.shape) * SHAPES[args.shape][0]
    print(f"shape {args.shape}: {SHAPES[args.shape][0]} blocks of {block_bytes(args.shape) >> 10} KiB "
          f"({size / 2**20:.1f} MiB a request), device {args.device}, UCX_TLS={os.environ.get('UCX_TLS', '(all)')}")
    parent, child = multiprocessing.Pipe()
    source = multiprocessing.get_context("spawn").Process(target=serve, args=(args.shape, args.device, child),
                                                          daemon=True)
    source.start()
    p50s: dict[str, list[float]] = {via: [] for via in vias}
    try:
        address = parent.recv()
        for via in vias:
            if channel_for(address, via) != via:
                raise SystemExit(f"the source offers no {via} here")
        puller = Puller(args.shape, args.device)
        for number in range(1, args.runs + 1):
            times = asyncio.run(run(address, puller, vias, args.requests))
            tcp = statistics.median(times["tcp"]) if "tcp" in times else None
            print(f"run {number}: {'channel':<7} {'p50 ms':>9} {'p99 ms':>9} {'GB/s':>7} {'vs tcp':>7}")
            for via in vias:
                median = statistics.median(times[via])
                p50s[via].append(median)
                ratio = f"{median / tcp:>7.2f}" if tcp else f"{'-':>7}"
                print(f"       {via:<7} {median * 1e3:>9.2f} {p99(times[via]) * 1e3:>9.2f} {size / median / 1e9:>7.3f}"
                      f" {ratio}")
    finally:
        source.kill()
    print(f"over {args.runs} runs: {'channel':<7} {'p50 ms (min-max)':>22} {'GB/s (min-max)':>16}")
    for via in vias:
        low, high = min(p50s[via]), max(p50s[via])
        print(f"{'':>14}{via:<7} {low * 1e3:>10.2f}-{high * 1e3:<10.2f} {size / high / 1e9:>7.3f}-{size / low / 1e9:<7.3f}")
    if args.goal_gbps and "nixl" in vias:
        slowest = size / max(p50s["nixl"]) / 1e9
        print(f"goal: nixl >= {args.goal_gbps:g} GB/s at the p50 of every run: {slowest:.3f} GB/s in the slowest run, "
              f"{'met' if slowest >= args.goal_gbps else 'NOT met'}")


if __name__ == "__main__":
    main()
