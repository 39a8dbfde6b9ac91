"""A source that misbehaves on purpose, for tests (SGLang's `fake` transfer backend and vLLM's FakeNixlWrapper play
the same part): `python -m engine --kv-transfer-fault F` makes every pull this engine serves go wrong so, whatever the
channel (tcp, shm, nixl). The puller must recompute each time and never serve what it got.

    fail-halfway   half the blocks go out, then the connection drops
    stall          the source sleeps past the puller's timeout before answering
    corrupt        the first block arrives with other bytes than its own (tcp and shm: a flipped byte in its
                   payload; nixl: its first chunk written from another page)
"""

import asyncio
from enum import StrEnum

from engine.kv.transport import Channel, Transport, write_frame


class Fault(StrEnum):
    FAIL_HALFWAY = "fail-halfway"
    STALL = "stall"
    CORRUPT = "corrupt"


class InjectedFault(ConnectionError):
    """The connection a fail-halfway source drops."""


def corrupted(payload: bytes) -> bytes:
    """The payload with its last byte (one of its KV bytes) flipped."""
    return payload[:-1] + bytes([payload[-1] ^ 0xFF]) if payload else payload


class FaultyTransport(Transport):
    """A tcp or shm transport whose offers go wrong as `fault` says."""

    def __init__(self, inner: Transport, fault: Fault, *, stall_s: float) -> None:
        self.inner = inner
        self.fault = fault
        self.stall_s = stall_s
        self.name = inner.name

    async def offer(self, payloads: list[bytes], channel: Channel) -> None:
        if self.fault == Fault.STALL:
            await asyncio.sleep(self.stall_s)
        elif self.fault == Fault.CORRUPT and payloads:
            payloads = [corrupted(payloads[0]), *payloads[1:]]
        elif self.fault == Fault.FAIL_HALFWAY:
            await write_frame(channel, {"op": "blocks", "via": "tcp", "sizes": [len(p) for p in payloads]},
                              payloads[: len(payloads) // 2])
            raise InjectedFault(f"dropped after {len(payloads) // 2} of {len(payloads)} blocks")
        await self.inner.offer(payloads, channel)

    async def accept(self, header: dict, channel: Channel) -> list[bytes]:
        return await self.inner.accept(header, channel)

    def discard(self) -> None:
        self.inner.discard()
