"""KV block transfer between two engine processes on one host: shared memory against TCP, side by side.

    .venv/bin/python -m benchmarks.kv_transfer [--rounds 5] [--quick]

A source process runs engine/kv/transport.py's TransferServer over leases of random payloads; this process pulls
each lease once (`Pull.fetch` then `done`, what a decode hop does) over TCP and over shared memory (/dev/shm), the
order alternating by round. Two shapes of a prompt's KV:

    tiny       64 blocks of 8 KiB    (the test models: 2 layers, 1 KV head of 32, fp32, 16 tokens a block)
    llama-8b   32 blocks of 2 MiB    (Llama-3-8B in bfloat16: 32 layers, 8 KV heads of 128, 16 tokens a block:
                                      a 512-token prompt)

Printed per shape and channel: the median pull time over rounds (until the bytes are read once, into a buffer of
the puller's, as payload.decode reads them), its throughput, and shm's time as a fraction of TCP's. Only the
channel is measured: no engine reads or writes pages here (on CUDA the pinned staging copies come on top, on CPU
the encode/decode of engine/kv/payload.py).
"""

import argparse
import asyncio
import multiprocessing
import os
import statistics
import time

from engine.kv.transport import LeaseRefused, Pull, TransferServer

SHAPES = {"tiny": (64, 8 << 10), "llama-8b": (32, 2 << 20)}


def serve(shapes: dict[str, tuple[int, int]], rounds: int, ready) -> None:
    """The source process: one lease per (shape, channel, round), each payload random bytes."""
    leases = {f"{name}-{via}-{r}": [os.urandom(size) for _ in range(count)]
              for name, (count, size) in shapes.items() for via in ("tcp", "shm") for r in range(rounds)}

    async def blocks(lease_id: str, keys: list[str]) -> list[bytes]:
        if lease_id not in leases:
            raise LeaseRefused(f"no lease {lease_id}")
        return leases.pop(lease_id)

    async def release(lease_id: str, reason: str) -> None:
        pass

    async def main() -> None:
        server = await TransferServer(blocks=blocks, release=release, host="127.0.0.1").start()
        ready.send(server.address)
        await asyncio.Event().wait()

    asyncio.run(main())


async def pull(address: dict, lease_id: str, count: int, via: str) -> float:
    started = time.perf_counter()
    async with Pull(address, lease_id, timeout_s=60, prefer_shm=via == "shm") as transfer:
        assert transfer.via == via, (transfer.via, via)
        payloads = await transfer.fetch([f"{i:032x}" for i in range(count)])
        received = [bytearray(payload) for payload in payloads]  # read once, as payload.decode does
        await transfer.done()
    assert len(received) == count
    return time.perf_counter() - started


async def measure(address: dict, shapes: dict, rounds: int) -> dict[tuple[str, str], list[float]]:
    times: dict[tuple[str, str], list[float]] = {}
    for name, (count, _) in shapes.items():
        for r in range(rounds):
            for via in (("tcp", "shm") if r % 2 == 0 else ("shm", "tcp")):
                times.setdefault((name, via), []).append(await pull(address, f"{name}-{via}-{r}", count, via))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 rounds, the tiny shape only")
    args = parser.parse_args()
    shapes = {"tiny": SHAPES["tiny"]} if args.quick else SHAPES
    rounds = 2 if args.quick else args.rounds
    parent, child = multiprocessing.Pipe()
    source = multiprocessing.get_context("spawn").Process(target=serve, args=(shapes, rounds, child), daemon=True)
    source.start()
    try:
        address = parent.recv()
        if not address["shm"]:
            raise SystemExit("no /dev/shm here: only TCP can be measured")
        times = asyncio.run(measure(address, shapes, rounds))
    finally:
        source.kill()
    print(f"{'shape':<10} {'blocks':>6} {'block':>8} {'channel':<7} {'median ms':>10} {'MB/s':>8} {'vs tcp':>7}")
    for name, (count, size) in shapes.items():
        tcp = statistics.median(times[(name, "tcp")])
        for via in ("tcp", "shm"):
            median = statistics.median(times[(name, via)])
            print(f"{name:<10} {count:>6} {size >> 10:>6}Ki {via:<7} {median * 1000:>10.2f} "
                  f"{count * size / median / 1e6:>8.0f} {median / tcp:>7.2f}")


if __name__ == "__main__":
    main()
