"""The benchmarks' own load: streamed HTTP/1.1 POSTs on aiohttp's keep-alive connections, each request's body built
once, each response read as it arrives for the time to its first event and its end. A request's head and body leave
in two writes, as httpx (so the openai SDK) sends them: a server then reads twice, as it does for real clients.

A load generator on the machine it measures takes CPU from what it measures. httpx's client costs several times the
gateway's CPU per streamed request, and at 50 streams it keeps one of two cores busy; aiohttp's (its parsers in C)
costs a fraction of that (docs/gateway-performance.md, "The load's client")."""

import json
import time
from dataclasses import dataclass

import aiohttp

KEEP_ALIVE_SECONDS = 1.0  # idle connections close long before a server's keep-alive would close them under a request
# httpx writes a request's head and its body apart, with its own work between: a server in another process got
# them in two arrivals for 297 requests of 300, 46 us apart (median; this machine, 2026-11-29). A server then reads
# twice and may wake twice, so the lean client leaves the same gap (docs/gateway-performance.md, "The load's client").
BODY_GAP_SECONDS = 0.00005


class ResponseFailed(ConnectionError):
    """A response that was not a streamed 200, or a connection that broke before the response's end."""


@dataclass(frozen=True)
class Prepared:
    """A request built once: where it goes, its headers and its body's bytes."""

    url: str
    headers: dict[str, str]
    body: bytes


def prepared_request(url: str, *, json_body: object, headers: dict[str, str]) -> Prepared:
    body = json.dumps(json_body, separators=(",", ":")).encode()
    return Prepared(url, {**headers, "Content-Type": "application/json"}, body)


async def head_then_body(body: bytes, gap_s: float):
    """The body as aiohttp streams it: an empty first piece sends the head alone, the body follows `gap_s` later
    (the client blocks that long, as httpx's own work does: a timer of the loop would wait a millisecond)."""
    yield b""
    time.sleep(gap_s)
    yield body


class LeanClient:
    """One aiohttp session: keep-alive connections per server, one request at a time on each; each request's head
    and body `body_gap_s` apart."""

    def __init__(self, *, body_gap_s: float = BODY_GAP_SECONDS) -> None:
        self.session: aiohttp.ClientSession | None = None
        self.body_gap_s = body_gap_s

    async def post(self, request: Prepared, marker: bytes, *, body: bytes | None = None) -> float | None:
        """Sends `request` (with `body` in place of its own, if given); when the response came whole, the time its
        first piece holding `marker` arrived (time.perf_counter), or None if none did. ResponseFailed if it was not
        a streamed (chunked) 200."""
        if self.session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEP_ALIVE_SECONDS)
            self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600))
        first = None
        try:
            data = request.body if body is None else body
            async with self.session.post(request.url, data=head_then_body(data, self.body_gap_s),
                                         headers={**request.headers, "Content-Length": str(len(data))}) as response:
                if response.status != 200 or response.headers.get("Transfer-Encoding", "").lower() != "chunked":
                    version = response.version
                    raise ResponseFailed(f"HTTP/{version.major}.{version.minor} {response.status} {response.reason}")
                async for data in response.content.iter_any():
                    if first is None and marker in data:
                        first = time.perf_counter()
        except aiohttp.ClientError as error:
            raise ResponseFailed(f"the connection broke: {type(error).__name__} {error}") from error
        return first

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
