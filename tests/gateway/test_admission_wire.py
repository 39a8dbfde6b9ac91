"""Admission's per-request scripts over the lean wire: the bytes it sends are those of packing every key and argument
anew (what it did before it packed a tenant's keys and a plan's limits once), and a request's two scripts never ask
asyncio for the running loop (CPython's lookup is a getpid() syscall)."""

import asyncio
import os
import threading
import time
import uuid

from gateway.admission.limits import Limits
from gateway.admission.redis_backend import _WIRE, RedisAdmission
from gateway.admission.redis_wire import pack

DECISION = b"*7\r\n:1\r\n$2\r\nok\r\n:1\r\n:10\r\n:60000\r\n:0\r\n:0\r\n"
SHAS = {_WIRE["acquire"].sha: "acquire", _WIRE["settle"].sha: "settle"}
SOURCES = {_WIRE["acquire"].source: "acquire", _WIRE["settle"].source: "settle"}


async def _fake_redis(received: list[bytes], *, uncached: set[str]):
    """Records each command whole; answers acquire with an admission, settle with 1, and an EVALSHA of a script in
    `uncached` with NOSCRIPT (once: the EVAL that follows caches it)."""

    async def serve(reader, writer):
        try:
            await answer(reader, writer)
        except (asyncio.CancelledError, ConnectionError):  # the test is over
            writer.close()

    async def answer(reader, writer):
        while header := await reader.readline():
            command, parts = [header], []
            for _ in range(int(header[1:])):
                size = await reader.readline()
                data = await reader.readexactly(int(size[1:]) + 2)
                command += [size, data]
                parts.append(data[:-2])
            received.append(b"".join(command))
            name = SHAS.get(parts[1]) or SOURCES.get(parts[1])
            if parts[0] == b"EVALSHA" and name in uncached:
                uncached.discard(name)
                writer.write(b"-NOSCRIPT No matching script. Please use EVAL.\r\n")
            else:
                writer.write(DECISION if name == "acquire" else b":1\r\n")

    return await asyncio.start_server(serve, "127.0.0.1", 0)


def _old_keys(prefix: str, tenant_id: int, month: str, request_id: str = "-") -> list[str]:
    base = f"{prefix}:{{t{tenant_id}}}"
    return [f"{base}:win", f"{base}:holds", f"{base}:holdinfo", f"{base}:held", f"{base}:month:{month}",
            f"{base}:settled:{request_id}", f"{base}:prov:{month}", f"{base}:keywin", f"{base}:keyheld",
            f"{base}:keymonth:{month}", f"{base}:unreported", f"{base}:unreported_at", f"{base}:leases"]  # fmt: skip


CASES = [  # (tenant, request id, tokens, spend micros, key spend picos, limits, final, usage)
    (7, "a1b2c3", 120, 3452, 3452000000, Limits(60, 100_000, 10, -1, 5_000_000), True, ""),
    (7, "a1b2c4", 0, 0, 0, Limits(60, 100_000, 10, -1, 5_000_000), False, '{"prompt_tokens": 3}'),
    (12, "r\u00e9q-\u00fc", 1, 1, 999999999999999, Limits(1, 2, 3, 4, 5, "kp\u00e9", 6, 7, 8), False,
     '{"note": "caf\u00e9 \u2603"}'),
    (12, "r-2", 10**12, 10**15, 10**21, Limits(1, 2, 3, 4, 5, "kp\u00e9", 6, 7, 8), True, ""),
    (12, "r-3", 5, 6, 7, Limits(1, 2, 3, 4, 5, "other", -1, -1, -1), False, "x" * 3000),
]  # fmt: skip


def test_the_bytes_sent_are_those_of_packing_every_key_and_argument(monkeypatch):
    """The old framing, `pack(EVALSHA, sha, 13, *keys, *args)` (and EVAL with the source after NOSCRIPT), built
    here from the scripts' documented keys and arguments, for tenants and limits seen before and not; a tenant's
    first settle that keeps its usage marks it in `unreported_tenants` first."""
    monkeypatch.setattr("gateway.admission.redis_backend.current_month", lambda: "2026-11")
    monkeypatch.setattr(time, "time", lambda: 1796600000.25)
    marked: set[int] = set()
    prefix = "quilt-\u00e9"
    received: list[bytes] = []

    async def main():
        server = await _fake_redis(received, uncached={"acquire", "settle"})
        admission = RedisAdmission(url=f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0", prefix=prefix,
                                   hold_ttl_seconds=900)  # fmt: skip
        expected, first = [], True
        for tenant, request_id, tokens, spend, picos, limits, final, usage in CASES:
            decision = await admission.acquire(tenant_id=tenant, request_id=request_id, tokens=tokens,
                                               spend_micros=spend, key_spend_picos=picos, limits=limits)  # fmt: skip
            assert decision.admitted and decision.reason == "ok"
            args = [request_id, tokens, spend, limits.requests_per_minute, limits.tokens_per_minute,
                    limits.max_concurrent, limits.budget_tokens, limits.budget_spend_micros, 900, limits.key_prefix,
                    limits.key_requests_per_minute, limits.key_tokens_per_minute, limits.key_budget_spend_picos,
                    picos]  # fmt: skip
            keys = _old_keys(prefix, tenant, "2026-11")
            expected.append(pack(b"EVALSHA", _WIRE["acquire"].sha, 13, *keys, *args))
            if first:  # NOSCRIPT: sent again by source
                expected.append(pack(b"EVAL", _WIRE["acquire"].source, 13, *keys, *args))
            assert await admission.settle(tenant_id=tenant, request_id=request_id, tokens=tokens, spend_micros=spend,
                                          key_spend_picos=picos, final=final, key_prefix=limits.key_prefix,
                                          usage=usage)  # fmt: skip
            if usage and tenant not in marked:
                marked.add(tenant)
                expected.append(pack(b"EVALSHA", _WIRE["mark_unreported"].sha, 1, f"{prefix}:unreported_tenants",
                                     tenant, "1796600000.25"))  # fmt: skip
            keys = _old_keys(prefix, tenant, "2026-11", request_id)
            args = [request_id, tokens, spend, int(final), limits.key_prefix, picos, usage]
            expected.append(pack(b"EVALSHA", _WIRE["settle"].sha, 13, *keys, *args))
            if first:
                expected.append(pack(b"EVAL", _WIRE["settle"].source, 13, *keys, *args))
            first = False
        server.close()
        return expected

    expected = asyncio.run(main())
    assert len(received) == len(expected) == 2 * len(CASES) + 2 + len(marked)
    for sent, old in zip(received, expected, strict=True):
        assert sent == old


def test_each_running_loop_gets_its_own_connections():
    """Loops one after another in one thread, and two at once in two threads: each script runs on connections of the
    loop that awaits it (a future of another loop would fail the await)."""
    admission = RedisAdmission(url=os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379") + "/13",
                               prefix=f"quilt-loops-{uuid.uuid4().hex[:8]}", hold_ttl_seconds=900)  # fmt: skip
    both_running = threading.Barrier(2)
    failures: list[BaseException] = []

    async def peeks(wait: bool):
        for number in range(5):
            assert (await admission.peek(tenant_id=1)).reason == "ok"
            if number == 0 and wait:
                await asyncio.to_thread(both_running.wait, 5)

    def in_thread():
        try:
            asyncio.run(peeks(True))
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            failures.append(error)

    asyncio.run(peeks(False))
    asyncio.run(peeks(False))  # the last loop closed: a new loop, a new wire
    threads = [threading.Thread(target=in_thread) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert failures == []
