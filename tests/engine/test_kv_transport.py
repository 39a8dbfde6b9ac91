"""The KV transfer channel alone (engine/kv/transport.py), over real sockets and /dev/shm: payloads of odd sizes
arrive intact over TCP and shared memory, a lease is released exactly once whether the puller is done, gives up,
times out or goes away, and a source that dies mid-transfer fails the pull at once with a clear code."""

import asyncio
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from engine.kv.transport import (
    PATH,
    SHM_ROOT,
    LeaseRefused,
    Pull,
    TransferError,
    TransferServer,
    release_remote,
    shm_reachable,
    transfer_address,
    write_frame,
)

ODD_SIZES = [0, 1, 7, 4097, (1 << 20) + 3, 5]


class Source:
    """A lease table in miniature: lease id -> payloads; records every release."""

    def __init__(self, leases: dict[str, list[bytes]], *, delay_s: float = 0.0) -> None:
        self.leases = leases
        self.delay_s = delay_s
        self.released: list[tuple[str, str]] = []
        self.asked: list[list[str]] = []

    async def blocks(self, lease_id: str, keys: list[str]) -> list[bytes]:
        self.asked.append(keys)
        await asyncio.sleep(self.delay_s)
        if lease_id not in self.leases:
            raise LeaseRefused(f"no lease {lease_id}")
        return self.leases[lease_id][: len(keys)]

    async def release(self, lease_id: str, why: str) -> None:
        self.released.append((lease_id, why))


def payloads(sizes: list[int], seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(n) for n in sizes]


async def serve(source: Source, **kwargs) -> TransferServer:
    return await TransferServer(blocks=source.blocks, release=source.release, host="127.0.0.1", **kwargs).start()


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("via", ["tcp", "shm"])
def test_odd_sized_payloads_arrive_intact_and_the_lease_is_released_once(via):
    sent = payloads(ODD_SIZES)
    keys = [f"{i:032x}" for i in range(len(sent))]

    async def main():
        source = Source({"lease-1": sent})
        server = await serve(source, shm=via == "shm")
        try:
            assert shm_reachable(server.address) == (via == "shm")
            async with Pull(server.address, "lease-1", timeout_s=10) as pull:
                assert pull.via == via
                got = await pull.fetch(keys)
                assert got == sent
                assert source.asked == [keys]
                if via == "shm":  # mapped by the puller, and its name gone at once
                    assert all(isinstance(p, memoryview) for p in got)
                    assert not list(SHM_ROOT.glob(f"{server.shm_name}.*"))
                await pull.done()
            assert source.released == [("lease-1", "done")]
            assert not list(SHM_ROOT.glob(f"{server.shm_name}.*")) if via == "shm" else True
        finally:
            await server.close()
        if via == "shm":
            assert not (SHM_ROOT / server.shm_name).exists()  # the marker goes with the server

    asyncio.run(main())


def test_a_prefix_of_the_keys_and_a_pull_without_shm_on_the_source():
    async def main():
        source = Source({"lease-2": payloads([3, 9])})
        server = await serve(source, shm=False)
        try:
            assert server.address["shm"] is None and not shm_reachable(server.address)
            async with Pull(server.address, "lease-2", timeout_s=10) as pull:
                assert pull.via == "tcp"
                assert len(await pull.fetch(["a" * 32, "b" * 32, "c" * 32])) == 2  # the source holds two
                await pull.done(reason="keys did not match")
            assert source.released == [("lease-2", "released")]
        finally:
            await server.close()

    asyncio.run(main())


def test_an_unknown_lease_is_refused_and_nothing_is_released():
    async def main():
        source = Source({})
        server = await serve(source)
        try:
            async with Pull(server.address, "nope", timeout_s=10) as pull:
                with pytest.raises(TransferError) as refused:
                    await pull.fetch(["a" * 32])
            assert refused.value.code == "unknown_lease" and "no lease nope" in str(refused.value)
            await asyncio.sleep(0.1)
            assert source.released == []
        finally:
            await server.close()

    asyncio.run(main())


def test_a_slow_source_times_out_and_the_lease_is_released_by_the_hang_up():
    async def main():
        source = Source({"lease-3": payloads([10])}, delay_s=1.0)
        server = await serve(source)
        try:
            started = asyncio.get_running_loop().time()
            with pytest.raises(TransferError) as timed_out:
                async with Pull(server.address, "lease-3", timeout_s=0.2) as pull:
                    await pull.fetch(["a" * 32])
            assert timed_out.value.code == "timeout"
            assert asyncio.get_running_loop().time() - started < 0.9
            await until(lambda: source.released)
            assert source.released == [("lease-3", "closed")]
        finally:
            await server.close()

    asyncio.run(main())


def channel_url(server: TransferServer, lease_id: str | None = None) -> str:
    return f"http://{server.address['tcp']}{PATH}" + (f"?lease={lease_id}" if lease_id else "")


def test_a_puller_that_hangs_up_mid_transfer_releases_the_lease():
    big = payloads([64 << 20])  # more than the socket buffers hold: the source is still writing

    async def main():
        source = Source({"lease-4": big})
        server = await serve(source, shm=False)
        try:
            async with aiohttp.ClientSession() as session:
                channel = await session.ws_connect(channel_url(server, "lease-4"), max_msg_size=0)
                await write_frame(channel, {"op": "pull", "keys": ["a" * 32], "via": "tcp"})
                assert (await channel.receive()).json()["op"] == "blocks"  # the header; the bytes are on their way
            # gone, mid-transfer: the session's close drops the connection
            await until(lambda: source.released)
            assert source.released == [("lease-4", "closed")]
        finally:
            await server.close()

    asyncio.run(main())


async def dying_source(handler) -> tuple[web.AppRunner, str]:
    """A source that breaks the protocol its own way: `handler(request, channel)` on the channel's endpoint."""

    async def serve(request: web.Request) -> web.WebSocketResponse:
        channel = web.WebSocketResponse()
        await channel.prepare(request)
        await handler(request, channel)
        return channel

    app = web.Application()
    app.router.add_get(PATH, serve)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"127.0.0.1:{runner.addresses[0][1]}"


def test_a_source_that_dies_mid_transfer_fails_the_pull_at_once():
    async def half_a_transfer(request, channel):  # promises two payloads, sends one, dies
        await channel.receive()
        await channel.send_str('{"op":"blocks","via":"tcp","sizes":[100,1000]}')
        await channel.send_bytes(b"x" * 100)
        request.transport.abort()

    async def main():
        runner, address = await dying_source(half_a_transfer)
        try:
            with pytest.raises(TransferError) as closed:
                async with Pull({"tcp": address, "shm": None}, "lease-5", timeout_s=10) as pull:
                    await pull.fetch(["a" * 32, "b" * 32])
            assert closed.value.code == "closed" and "after 1 of 2 payloads" in str(closed.value)
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_a_payload_of_another_size_than_announced_is_a_protocol_error():
    async def short_payload(request, channel):
        await channel.receive()
        await channel.send_str('{"op":"blocks","via":"tcp","sizes":[1000]}')
        await channel.send_bytes(b"x" * 100)
        await channel.receive()

    async def main():
        runner, address = await dying_source(short_payload)
        try:
            with pytest.raises(TransferError) as broken:
                async with Pull({"tcp": address, "shm": None}, "lease-5", timeout_s=10) as pull:
                    await pull.fetch(["a" * 32])
            assert broken.value.code == "protocol" and "not the 1000 bytes announced" in str(broken.value)
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_a_source_closing_while_a_pull_waits_fails_it_and_releases_the_lease():
    async def main():
        source = Source({"lease-6": payloads([10])}, delay_s=30.0)
        server = await serve(source)
        async with Pull(server.address, "lease-6", timeout_s=10) as pull:
            fetch = asyncio.create_task(pull.fetch(["a" * 32]))
            await until(lambda: source.asked)
            await server.close()  # the prefill engine shuts down
            with pytest.raises(TransferError) as closed:
                await fetch
        assert closed.value.code == "closed"
        assert source.released == [("lease-6", "drain")]

    asyncio.run(main())


def test_nobody_listening_and_a_bad_address_are_transfer_errors():
    async def main():
        with socket.socket() as unused:  # a port nobody listens on
            unused.bind(("127.0.0.1", 0))
            port = unused.getsockname()[1]
        with pytest.raises(TransferError) as refused:
            async with Pull({"tcp": f"127.0.0.1:{port}"}, "x", timeout_s=2):
                pass
        assert refused.value.code == "closed"
        with pytest.raises(TransferError) as bad:
            async with Pull({"tcp": "no-port"}, "x", timeout_s=2):
                pass
        assert bad.value.code == "protocol"

    asyncio.run(main())


def test_release_without_pulling_and_garbage_on_the_wire():
    async def main():
        source = Source({"lease-7": payloads([4])})
        server = await serve(source)
        try:
            assert await release_remote(server.address, "lease-7", reason="aborted before the pull")
            assert source.released == [("lease-7", "released")]
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://{server.address['tcp']}/") as answer:
                    assert answer.status == 404  # not the channel
                for url in (channel_url(server, "lease-x"), channel_url(server)):
                    async with session.get(url) as answer:
                        assert answer.status == 400  # the channel's endpoint, but no WebSocket, or no lease named
                for garbage in (os.urandom(64), "not json", '{"no": "op"}', '{"op": "fetch"}'):
                    channel = await session.ws_connect(channel_url(server, "lease-x"))
                    await (channel.send_bytes(garbage) if isinstance(garbage, bytes) else channel.send_str(garbage))
                    assert (await channel.receive()).type == aiohttp.WSMsgType.CLOSE  # hung up on
                    await channel.close()
            # lease-7 released once; each broken connection gave its own lease up (one nobody holds: a no-op)
            assert source.released == [("lease-7", "released")] + [("lease-x", "closed")] * 4
        finally:
            await server.close()

    asyncio.run(main())


DYING_SOURCE = """
import asyncio, sys
from engine.kv.transport import SHM_ROOT, TransferServer

async def main():
    async def blocks(lease_id, keys):
        return []
    async def release(lease_id, reason):
        pass
    server = await TransferServer(blocks=blocks, release=release, host="127.0.0.1").start()
    (SHM_ROOT / f"{server.shm_name}.0123456789abcdef").write_bytes(b"a segment a puller never mapped")
    print(server.shm_name, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="no /dev/shm")
def test_a_sigkilled_source_leaves_files_in_dev_shm_that_the_next_source_reaps():
    """kill -9 runs no cleanup: the source's marker (and a segment it offered) stay in /dev/shm. The next engine to
    start on the host removes them; a live source's files are never touched."""
    dying = subprocess.Popen([sys.executable, "-c", DYING_SOURCE], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    try:
        name = dying.stdout.readline().strip()
        assert name.startswith("quilt-kv-"), name
    finally:
        dying.kill()
        dying.wait()
    left = sorted(path.name for path in SHM_ROOT.glob(f"{name}*"))
    assert left == [name, f"{name}.0123456789abcdef"]  # what a SIGKILL leaves

    async def main():
        alive = await serve(Source({}))
        (SHM_ROOT / f"{alive.shm_name}.fedcba9876543210").write_bytes(b"an offer in flight")
        try:
            successor = await serve(Source({}))
            try:
                assert not list(SHM_ROOT.glob(f"{name}*"))  # reaped
                assert (SHM_ROOT / alive.shm_name).exists()  # a live source keeps its marker and its segments
                assert (SHM_ROOT / f"{alive.shm_name}.fedcba9876543210").exists()
                assert shm_reachable(alive.address) and shm_reachable(successor.address)
            finally:
                await successor.close()
        finally:
            await alive.close()
        assert not list(SHM_ROOT.glob(f"{alive.shm_name}*"))  # a clean close leaves nothing either

    asyncio.run(main())


def test_a_transfer_address_is_any_host_the_resolver_may_take():
    assert transfer_address("engine_prefill:8100") == ("engine_prefill", 8100)  # a compose service's name
    assert transfer_address("prefill-0.engines.quilt.svc.cluster.local:9000")[1] == 9000
    assert transfer_address("10.0.0.3:1") == ("10.0.0.3", 1)
    assert transfer_address("[::1]:8100") == ("::1", 8100)
    for bad in ("nowhere", "h:0", "h:65536", "h:port", ":80", "a b:1", "http://h:1", "h/x:1", "::1:80", "[zz]:1",
                "h\n:1", None, 8100, "h:" + "9" * 400):
        assert transfer_address(bad) is None, bad


def test_a_pull_reaches_a_source_by_host_name():
    async def main():
        source = Source({"lease-n": payloads([9, 3])})
        server = await serve(source)
        try:
            port = server.address["tcp"].rsplit(":", 1)[1]
            async with Pull({"tcp": f"localhost:{port}", "shm": None}, "lease-n", timeout_s=10) as pull:
                assert await pull.fetch(["a" * 32, "b" * 32]) == payloads([9, 3])
                await pull.done()
        finally:
            await server.close()

    asyncio.run(main())
