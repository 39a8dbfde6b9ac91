"""What blocking and being woken cost this machine's CPU, the part of the gateway's CPU per request that moves most
from machine to machine: a round trip to the local Redis from plain Python, a sleep
alone (one block and one wake-up), a write that wakes Redis with no reply asked for, and a round trip through the
gateway's Redis client (`gateway.admission.redis_client`) on uvloop, all in this one process, side by side.

    python -m benchmarks.wake_costs [--redis redis://127.0.0.1:6379/0] [--count 3000] [--rounds 3]

CPU time of this thread (time.thread_time) per operation, in µs. A machine where these are two or three times
another's reads the gateway's figure about twice as high: compare machines by these, not by the gateway's
milliseconds. Run it on a quiet machine, as gateway_overhead.py is run: with the other CPUs busy, fewer waits end
on an idle CPU that must be woken, and the figures fall. Nothing is asserted.
"""

import argparse
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

import hiredis  # noqa: E402

ARGUMENT = b"a" * 600  # about the size of admission's acquire


def per_operation(operation, count: int) -> float:
    started = time.thread_time()
    for _ in range(count):
        operation()
    return (time.thread_time() - started) / count * 1e6


def blocking_costs(host: str, port: int, count: int) -> tuple[float, float, float]:
    """A round trip, a 0.3 ms sleep alone, and a write with no reply (Redis's CLIENT REPLY OFF) then the same sleep."""
    script = hiredis.pack_command((b"EVAL", b"return 1", b"0", ARGUMENT))
    with socket.create_connection((host, port)) as asked, socket.create_connection((host, port)) as told:
        for connection in (asked, told):
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        told.sendall(hiredis.pack_command((b"CLIENT", b"REPLY", b"OFF")))
        round_trip = per_operation(lambda: (asked.sendall(script), asked.recv(64)), count)
        sleep = per_operation(lambda: time.sleep(0.0003), count)
        write = per_operation(lambda: (told.sendall(script), time.sleep(0.0003)), count) - sleep
    return round_trip, sleep, write


def client_cost(url: str, count: int) -> float:
    """A round trip through the gateway's Redis client (EVALSHA of a one-line script) on uvloop, one at a time."""
    import uvloop

    from gateway.admission.redis_client import ScriptCalls, loop_client

    async def run() -> float:
        calls = ScriptCalls(url, reply_seconds=5.0)
        script = loop_client(url, reply_seconds=5.0).register_script("return 1")
        for _ in range(200):
            await calls(script, [], [ARGUMENT])
        started = time.thread_time()
        for _ in range(count):
            await calls(script, [], [ARGUMENT])
        return (time.thread_time() - started) / count * 1e6

    return uvloop.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--count", type=int, default=3000, help="operations per measure")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    address = urlsplit(args.redis)
    for round_ in range(args.rounds):
        round_trip, sleep, write = blocking_costs(address.hostname or "127.0.0.1", address.port or 6379, args.count)
        client = client_cost(args.redis, args.count)
        print(f"round {round_}: CPU per operation, µs: round trip {round_trip:.1f}, sleep alone {sleep:.1f}, "
              f"write that wakes Redis {write:.1f}, round trip through the gateway's client on uvloop {client:.1f}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
