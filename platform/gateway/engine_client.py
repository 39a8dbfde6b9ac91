"""Talking to an engine's internal HTTP API: from the gateway's event loop through aiohttp (one session, so one
pool of keep-alive connections, per event loop), from the worker's blocking code through httpx. A streamed generate
goes on the engine's generate channel where the engine offers one (`gateway.engine_channel`).

aiohttp rather than httpx on the event loop: streaming the engine's NDJSON answer costs httpx several times the CPU
per request (benchmarks/engine_client_libs.py; docs/gateway-performance.md, "Engine calls")."""

import asyncio
import collections
import functools
import json
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import httpx
import msgspec
from django.conf import settings
from yarl import URL

from engine.contract import ADAPTER_UNAVAILABLE, KEEP_ALIVE_SECONDS, EngineState, StreamEvent, state_read
from engine.contract.channel import CHANNEL_MAX_BYTES
from gateway.engine_channel import ChannelBody, channel_to
from gateway.engine_events import decode_event
from gateway.hot_settings import hot


class EngineUnavailable(Exception):
    """The engine could not be reached or failed before sending anything: another one may serve the request."""


class EngineRejected(Exception):
    """The engine refused the request as invalid (its 4xx): the client's fault, not worth a retry."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param  # the engine's name of the field at fault ("prompt", "messages", "sampling.stop")
        self.code = code  # e.g. "context_length_exceeded"

    @classmethod
    def of(cls, status: int, response_body: bytes) -> "EngineRejected":
        _, param, code = _error_fields(response_body)
        return cls(status, _error_message(response_body), param=param or None, code=code)


class EngineBroke(Exception):
    """The engine failed after the stream had started."""


class AdapterUnavailable(Exception):
    """The engine could not load this request's adapter (missing, corrupt, wrong shape): this request fails, the
    engine stays healthy for everyone else. The message is the engine's, for logs only."""

def _error_fields(response_body: bytes) -> tuple[str | None, str, str | None]:
    """The engine's error type, param and code, from its answer's body."""
    try:
        body = json.loads(response_body)
    except ValueError:
        return None, "", None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return None, "", None
    return error.get("type"), str(error.get("param") or ""), error.get("code") or None


@dataclass(frozen=True)
class EngineRef:
    name: str
    url: str
    token: str
    pool: str
    gpu_price_per_hour: str
    resident: frozenset[str]  # adapter digests resident in any tier at the last check
    load: int  # running + waiting requests at the last check
    channel: str | None = None  # the path of its generate channel, if it serves one (engine.contract.channel)


IDLE_SECONDS = 2.0  # how long an idle connection is kept: well under the engine server's keep-alive timeout, so it
assert IDLE_SECONDS * 10 < KEEP_ALIVE_SECONDS  # never closes one first, even when this loop reads an answer's end late
JSON = "application/json"
# The requests' bodies are the engine's JSON, read as they are: no decompression, no default Accept headers; an engine
# sets no cookies (the session keeps none).
SKIPPED_HEADERS = ("User-Agent", "Accept", "Accept-Encoding")
# What a failed exchange with the engine raises: unreachable, reset, timed out, an answer that is not HTTP.
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)

# each event loop's session: its pool of keep-alive connections to every engine, and what closes it with the loop
_sessions: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[aiohttp.ClientSession, object]]" = (
    weakref.WeakKeyDictionary()
)


async def _kept_session() -> AsyncIterator[aiohttp.ClientSession]:
    """A session, kept open while its loop runs: the loop closes the async generators still suspended when it shuts
    down (`loop.shutdown_asyncgens`, which asyncio.run, asyncio.Runner and uvicorn call), and so this session."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=settings.QUILT_ENGINE_CONNECT_TIMEOUT_SECONDS,
                                    sock_read=settings.QUILT_ENGINE_READ_TIMEOUT_SECONDS)  # fmt: skip
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_SECONDS)
    session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                    skip_auto_headers=SKIPPED_HEADERS, cookie_jar=aiohttp.DummyCookieJar())  # fmt: skip
    try:
        yield session
    finally:
        await session.close()


async def _session() -> aiohttp.ClientSession:
    """The running loop's session (made at its first request)."""
    loop = asyncio.get_running_loop()
    kept = _sessions.get(loop)
    if kept is None or kept[0].closed:
        keeper = _kept_session()
        kept = _sessions[loop] = (await anext(keeper), keeper)  # the generator held with it, suspended
    return kept[0]


@functools.lru_cache(maxsize=1024)
def _url(base: str, path: str) -> URL:
    """An engine endpoint's URL, parsed once."""
    return URL(base + path)


@functools.lru_cache(maxsize=256)
def _post_headers_of(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", "Content-Type": JSON}


def _post_headers(engine: EngineRef) -> dict[str, str]:
    return _post_headers_of(engine.token or hot.QUILT_ENGINE_TOKEN)


def _headers(engine: EngineRef) -> dict[str, str]:
    return {"Authorization": f"Bearer {engine.token or settings.QUILT_ENGINE_TOKEN}"}


async def _post(url: URL, headers: dict[str, str], body: bytes, **options) -> aiohttp.ClientResponse:
    """Sends a POST and reads its answer's status and headers. One that the engine answered by closing the
    connection, with nothing sent back, is sent once more: a kept-alive connection the engine closed as it was
    reused (the engine never read the request, or aborted it as its connection closed)."""
    session = await _session()
    try:
        return await session.post(url, data=body, headers=headers, **options)
    except aiohttp.ClientConnectorError:
        raise
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientConnectionResetError):
        return await session.post(url, data=body, headers=headers, **options)


def encode(payload: dict) -> bytes:
    """A request's JSON body."""
    return msgspec.json.encode(payload)


def _error_message(response_body: bytes) -> str:
    try:
        body = json.loads(response_body)
    except ValueError:
        return response_body.decode(errors="replace")[:500]
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)
    return str(error)


class Body:
    """A streamed answer's body as it arrives, split into lines: `lines` holds the lines not yet taken (popleft
    them), `rest` the body after its last newline (its last line, once the answer is `complete`). `arrival()` waits
    for more; the failure of a wait (aiohttp's ClientError, a read timeout) is raised by it."""

    def __init__(self, response: aiohttp.ClientResponse):
        self.response = response
        self.status = response.status
        self.lines: collections.deque[bytes] = collections.deque()
        self.rest = b""
        self.complete = False  # the whole answer arrived

    async def arrival(self) -> None:
        content = self.response.content
        data = await content.readany()  # all that has arrived; at once if some has
        if data:
            parts = (self.rest + data).split(b"\n")
            self.rest = parts.pop()
            self.lines += parts
        self.complete = content.at_eof()

    def close(self) -> None:
        """Ends the exchange: an answer not read to its end closes its connection (the engine aborts the request);
        one read to its end has given its connection back already."""
        self.response.close()


class GenerateStream:
    """An open generate stream. `open()` raises EngineUnavailable / EngineRejected before any event; then the engine's
    events, as they arrive (`arrived`, `arrival`) or waited for (`events`); EngineBroke if the stream dies
    unfinished."""

    def __init__(self, engine: EngineRef, payload: dict):
        self.engine = engine
        self.payload = payload
        self.response: Body | ChannelBody | None = None
        self.finished = False  # its final event was taken (set by the reader as it applies it)
        self._broken: Exception | None = None  # the wait for the engine failed: raised by the next `arrived`

    async def open(self) -> "GenerateStream":
        engine, payload = self.engine, self.payload
        data = encode(payload)
        if engine.channel is not None and on_channel(payload) and len(data) <= CHANNEL_MAX_BYTES:
            return await self._open_on_channel(data)
        try:
            response = await _post(_url(engine.url, "/v1/generate"), _post_headers(engine), data)
        except TRANSPORT_ERRORS as error:
            raise EngineUnavailable(f"{engine.name}: {error!r}") from error
        if response.status >= 400:
            try:
                body = await response.read()
            except TRANSPORT_ERRORS:
                body = b""
            finally:
                response.close()
            raise _refusal(engine, response.status, body)
        self.response = Body(response)
        return self

    async def _open_on_channel(self, data: bytes) -> "GenerateStream":
        """`open` on the engine's generate channel: the request sent (on a new channel if the one kept had closed),
        its first message waited for (a refusal, or its first events)."""
        engine = self.engine
        request_id = self.payload["request_id"]
        read_timeout = settings.QUILT_ENGINE_READ_TIMEOUT_SECONDS
        try:
            key = (engine.url, engine.channel, engine.token)
            session, url, headers = await _session(), _url(engine.url, engine.channel), _headers(engine)
            channel = await channel_to(session, url, headers, key)
            try:
                body = await channel.send(request_id, data, read_timeout=read_timeout)
            except aiohttp.ClientConnectionError:  # it closed as the request went out: the engine never had it
                channel = await channel_to(session, url, headers, key)
                body = await channel.send(request_id, data, read_timeout=read_timeout)
            try:
                await body.arrival()
            except BaseException:
                body.close()
                raise
        except TRANSPORT_ERRORS as error:
            raise EngineUnavailable(f"{engine.name}: {error!r}") from error
        if body.status >= 400:
            body.close()
            raise _refusal(engine, body.status, body.error)
        self.response = body
        return self

    async def events(self) -> list[StreamEvent] | None:
        """The next events, waiting for them: those that arrived together (`arrived`); None at the answer's end
        (EngineBroke if it ended before the request finished)."""
        while not (events := self.arrived()):
            if not self.response.complete:
                await self.arrival()
            elif self.ended():
                return None
        return events

    def ended(self) -> bool:
        """Whether the answer has been read to its end (complete, every line taken); EngineBroke if it ended before
        the request finished."""
        response = self.response
        if not response.complete or response.lines or response.rest:
            return False
        if not self.finished:
            raise EngineBroke(f"{self.engine.name}: the stream ended before the request finished")
        return True

    def arrived(self) -> list[StreamEvent]:
        """The events that have arrived (`decode_event` of each line): the lines that came together, or when none is
        left, the body's last line, unterminated, once the answer is complete ([] if none). Blank lines are skipped.
        A line that is not JSON breaks the stream (EngineBroke) when it comes first: after others, it is left for the
        next call. EngineBroke too when the wait for the engine failed (`arrival`)."""
        if self._broken is not None:
            raise EngineBroke(f"{self.engine.name}: the stream broke: {self._broken!r}") from self._broken
        response = self.response
        lines = response.lines
        if not lines:
            if not (response.complete and response.rest):
                return []
            lines.append(response.rest)
            response.rest = b""
        events = []
        for taken, line in enumerate(lines):
            try:
                events.append(decode_event(line))
            except msgspec.DecodeError as error:
                if not line.strip():
                    continue
                if events:  # the events before it are read first; it stays, for the next call to refuse
                    for _ in range(taken):
                        lines.popleft()
                    return events
                lines.clear()
                raise EngineBroke(f"{self.engine.name}: the stream broke: {error!r}") from error
        lines.clear()
        return events

    async def arrival(self) -> None:
        """Waits until more of the answer has arrived (not at all if some did since `arrived` last took it, or the
        answer is complete); a failure is raised by the next `arrived` as EngineBroke."""
        response = self.response
        if response.lines or response.complete:
            return
        try:
            await response.arrival()
        except TRANSPORT_ERRORS as error:
            self._broken = error

    async def close(self) -> None:
        self.end()

    def end(self) -> None:
        """Closes the stream (`close` without its coroutine): an answer not read to its end closes its connection,
        which makes the engine abort the request."""
        if self.response is not None:
            self.response.close()


def on_channel(payload: dict) -> bool:
    """Whether a generate goes on the engine's channel (which carries streamed generates with an id, no hop)."""
    return payload.get("stream", True) is True and "request_id" in payload and payload.get("kv_transfer") is None


def _refusal(engine: EngineRef, status: int, body: bytes) -> Exception:
    """What a generate answered with an error status means for the gateway."""
    kind, param, _ = _error_fields(body)
    # An engine without the adapter-fault error type refuses an unreadable adapter as the request's fault
    # (a 4xx naming the adapter): the gateway sent that adapter itself, so it is the same fault.
    if kind == ADAPTER_UNAVAILABLE or (400 <= status < 500 and param.startswith("adapter")):
        return AdapterUnavailable(f"{engine.name}: {status} {_error_message(body)}")
    if status >= 500 or status in (401, 403, 404, 429):
        return EngineUnavailable(f"{engine.name}: generate answered {status}: {_error_message(body)}")
    return EngineRejected.of(status, body)


async def generate_whole(engine: EngineRef, payload: dict, *, timeout_s: float) -> dict:
    """POST /v1/generate for a JSON answer (the prefill hop: `stream` false), read whole within `timeout_s`.
    Raises EngineUnavailable (unreachable, 5xx, timed out, not JSON), AdapterUnavailable or EngineRejected, as
    GenerateStream.open does."""
    response: aiohttp.ClientResponse | None = None
    try:
        async with asyncio.timeout(timeout_s):
            response = await _post(_url(engine.url, "/v1/generate"), _post_headers(engine), encode(payload))
            content = await response.read()
    except TRANSPORT_ERRORS as error:
        raise EngineUnavailable(f"{engine.name}: {error!r}") from error
    finally:
        if response is not None:
            response.close()  # a no-op once read to its end; else (timed out, cancelled) the engine aborts it
    if response.status >= 400:
        raise _refusal(engine, response.status, content)
    try:
        answer = json.loads(content)
    except ValueError as error:
        raise EngineUnavailable(f"{engine.name}: generate answered {response.status} with no JSON") from error
    if not isinstance(answer, dict):
        raise EngineUnavailable(f"{engine.name}: generate answered {response.status} with no JSON object")
    return answer


async def prefetch(engine: EngineRef, *, adapter: dict, tier: str = "gpu") -> None:
    """Asks the engine to load an adapter (the generate request's "adapter": digest and path, or digest and signed
    URLs) ahead of a request (POST /v1/adapters/prefetch); a failure only means the request that follows loads it
    itself."""
    timeout = aiohttp.ClientTimeout(total=10.0)
    try:
        response = await _post(_url(engine.url, "/v1/adapters/prefetch"), _post_headers(engine),
                               encode({**adapter, "tier": tier}), timeout=timeout)  # fmt: skip
        async with response:
            await response.read()
    except TRANSPORT_ERRORS:
        pass


async def abort(engine: EngineRef, request_id: str) -> None:
    timeout = aiohttp.ClientTimeout(total=2.0)
    try:
        response = await _post(_url(engine.url, f"/v1/abort/{request_id}"), _headers(engine), b"", timeout=timeout)
        async with response:
            await response.read()
    except TRANSPORT_ERRORS:
        pass  # the engine also aborts when our stream connection closes


def state_sync(*, url: str, token: str, timeout: float = 3.0) -> EngineState:
    """GET /v1/health then /v1/state (used by the periodic health check, in a worker); BadState or WrongVersion
    (ValueErrors) naming what this side cannot read."""
    headers = {"Authorization": f"Bearer {token or settings.QUILT_ENGINE_TOKEN}"}
    with httpx.Client(timeout=timeout) as client:
        client.get(f"{url}/v1/health", headers=headers).raise_for_status()
        response = client.get(f"{url}/v1/state", headers=headers)
        response.raise_for_status()
        return state_read(response.json())


def prefetch_sync(*, url: str, token: str, adapter: dict, timeout: float = 10.0) -> None:
    headers = {"Authorization": f"Bearer {token or settings.QUILT_ENGINE_TOKEN}"}
    with httpx.Client(timeout=timeout) as client:
        client.post(f"{url}/v1/adapters/prefetch", json=adapter, headers=headers).raise_for_status()
