"""The benchmarks' own load, lean: HTTP/1.1 POSTs over keep-alive asyncio connections. Each request's bytes are
built once by httpx (the request line, headers and body httpx would send) and sent in httpx's two writes, the head
and then the body, as far apart as httpx sends them. Its chunked response is read in the connection's protocol
callback, for the time to its first event and its end.

A load generator on the machine it measures takes CPU from what it measures. httpx's client costs several times the
gateway's CPU per streamed request, and at 50 streams it keeps one of two cores busy; this one costs a fraction of
that (docs/gateway-performance.md, "The load's client")."""

import asyncio
import time
from urllib.parse import urlsplit

import httpx

# httpx writes a request's head and its body apart, with its own work between: a server in another process got
# them in two arrivals for 297 requests of 300, 46 us apart (median; this machine, 2026-11-29). A server then reads
# twice and may wake twice, so the lean client leaves the same gap (docs/gateway-performance.md, "The load's client").
BODY_GAP_SECONDS = 0.00005


class ResponseFailed(ConnectionError):
    """A response that was not a 200, or a connection that broke before the response's end."""


def raw_request(method: str, url: str, *, json: object, headers: dict[str, str]) -> bytes:
    """The request's bytes as httpx's client sends them (its default headers included)."""
    with httpx.Client() as client:  # the same default headers as its AsyncClient
        request = client.build_request(method, url, json=json, headers=headers)
    target = request.url.raw_path
    lines = [b"%b %b HTTP/1.1" % (method.encode(), target)]
    lines += [b"%b: %b" % (name, value) for name, value in request.headers.raw]
    return b"\r\n".join(lines) + b"\r\n\r\n" + request.read()


class _Connection(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future | None = None
        self.marker = b""
        self.first: float | None = None
        self.head_read = False
        self.lost = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.lost = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ResponseFailed(f"the connection was lost: {exc!r}"))

    def send(self, data: bytes, marker: bytes) -> asyncio.Future:
        """Writes the request as httpx does: its head, then its body, BODY_GAP_SECONDS later (the client blocks that
        long: a timer of the loop would wait a millisecond)."""
        self.waiter = self.loop.create_future()
        self.marker, self.first, self.head_read = marker, None, False
        split = data.index(b"\r\n\r\n") + 4
        self.transport.write(data[:split])
        if split < len(data):
            time.sleep(BODY_GAP_SECONDS)
            self.transport.write(data[split:])
        return self.waiter

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        position = 0
        if not self.head_read:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buffer[:end]).lower()
            if not head.startswith(b"http/1.1 200 ") or b"\r\ntransfer-encoding: chunked" not in head:
                waiter.set_exception(ResponseFailed(bytes(buffer[: buffer.find(b"\r\n")]).decode("latin-1")))
                self.transport.close()  # only streamed (chunked) 200s are read: the rest of this one is not
                return
            self.head_read, position = True, end + 4
        while True:  # chunks: a size line, the data, CR LF; the last one is empty
            line_end = buffer.find(b"\r\n", position)
            if line_end < 0:
                break
            size = int(buffer[position:line_end].split(b";", 1)[0], 16)
            if len(buffer) < line_end + 2 + size + 2:
                break
            if size == 0:
                del buffer[: line_end + 4]
                self.waiter = None
                waiter.set_result(self.first)
                return
            if self.first is None and buffer.find(self.marker, line_end + 2, line_end + 2 + size) >= 0:
                self.first = time.perf_counter()
            position = line_end + 2 + size + 2
        del buffer[:position]


class LeanClient:
    """Keep-alive connections per server, one request at a time on each."""

    def __init__(self):
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    async def post(self, url: str, data: bytes, marker: bytes) -> float | None:
        """Sends `data` (a whole request) to `url`'s server; when the response came whole, the time its first
        chunk holding `marker` arrived (time.perf_counter), or None if none did."""
        parts = urlsplit(url)
        address = (parts.hostname, parts.port)
        idle = self._idle.setdefault(address, [])
        connection = None
        while idle:
            connection = idle.pop()
            if not connection.lost and not connection.transport.is_closing():
                break
            connection = None
        if connection is None:
            loop = asyncio.get_running_loop()
            _, connection = await loop.create_connection(lambda: _Connection(loop), *address)
        try:
            first = await connection.send(data, marker)
        except BaseException:
            connection.transport.close()
            raise
        idle.append(connection)
        return first

    def close(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.transport.close()
        self._idle.clear()
