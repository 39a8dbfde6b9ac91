"""Talking to an engine's internal HTTP API: from the gateway's event loop through `engine_http` (one pool of
keep-alive connections per loop), from the worker's blocking code through httpx."""

import asyncio
import functools
import json
import weakref
from dataclasses import dataclass

import httpx
from django.conf import settings

from engine.contract import ADAPTER_UNAVAILABLE
from gateway.engine_http import EngineHTTP, EngineHTTPError, Response, prepared
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


_clients: "weakref.WeakKeyDictionary[object, EngineHTTP]" = weakref.WeakKeyDictionary()
JSON = "application/json"
# A payload's compact JSON through the C encoder that JSONEncoder(separators=(",", ":")).encode makes anew on every call
# (two frames, ~170 bytecodes a request), made once; no circular check (the exchange's payload is a tree)
_compact_chunks = json.encoder.c_make_encoder(None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii,
                                              None, ":", ",", False, False, True)  # fmt: skip
_scan_once = json.JSONDecoder().scan_once  # an event line as the engine writes it: json's C scanner, no Python frame


_last: tuple[object, EngineHTTP | None] = (None, None)  # the loop a request was last sent from, and its client


def _client() -> EngineHTTP:
    global _last
    loop = asyncio.get_running_loop()
    last_loop, client = _last
    if last_loop is not loop:  # another loop than the last request's (tests): its own client
        client = _clients.get(loop)
        if client is None:
            client = _clients[loop] = EngineHTTP(
                connect_timeout=settings.QUILT_ENGINE_CONNECT_TIMEOUT_SECONDS,
                read_timeout=settings.QUILT_ENGINE_READ_TIMEOUT_SECONDS,
            )
        _last = (loop, client)
    return client


def _post_headers(engine: EngineRef) -> dict[str, str]:
    return {"Authorization": f"Bearer {engine.token or hot.QUILT_ENGINE_TOKEN}", "Content-Type": JSON}


@functools.lru_cache(maxsize=256)
def _generate_request(url: str, token: str) -> tuple[tuple[str, int], bytes, bytes]:
    """An engine's generate request (`engine_http.prepared`), made once per engine URL and token."""
    return prepared("POST", f"{url}/v1/generate", {"Authorization": f"Bearer {token}", "Content-Type": JSON})


def _headers(engine: EngineRef) -> dict[str, str]:
    return {"Authorization": f"Bearer {engine.token or settings.QUILT_ENGINE_TOKEN}"}


def _error_message(response_body: bytes) -> str:
    try:
        body = json.loads(response_body)
    except ValueError:
        return response_body.decode(errors="replace")[:500]
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)
    return str(error)


class GenerateStream:
    """An open generate stream. `open()` raises EngineUnavailable / EngineRejected before any event; then the engine's
    events, as they arrive (`arrived`, `arrival`) or waited for (`events`); EngineBroke if the stream dies
    unfinished."""

    def __init__(self, engine: EngineRef, payload: dict):
        self.engine = engine
        self.payload = payload
        self.response: Response | None = None
        self.finished = False  # its final event was taken (set by the reader as it applies it)
        self._broken: EngineHTTPError | None = None  # the wait for the engine failed: raised by the next `arrived`

    async def open(self) -> "GenerateStream":
        address, head, rest = _generate_request(self.engine.url, self.engine.token or hot.QUILT_ENGINE_TOKEN)
        body = "".join(_compact_chunks(self.payload, 0)).encode()
        last_loop, client = _last  # `_client()` when it is the last request's loop, without its call
        if last_loop is not asyncio.get_running_loop():
            client = _client()
        try:
            self.response = await client.send(address, b"%b%d%b%b" % (head, len(body), rest, body))
        except EngineHTTPError as error:
            raise EngineUnavailable(f"{self.engine.name}: {error}") from error
        status = self.response.status
        if status >= 400:
            try:
                body = await self.response.aread()
            except EngineHTTPError:
                body = b""
            self.response.close()
            raise _refusal(self.engine, status, body)
        return self

    async def events(self) -> list[dict] | None:
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

    def arrived(self) -> list[dict]:
        """The events that have arrived, each parsed as json.loads parses its line: the lines that came together, or
        when none is left, the body's last line, unterminated, once the answer is complete ([] if none). A line that
        is not JSON breaks the stream (EngineBroke) when it comes first: after others, it is left for the next call.
        EngineBroke too when the wait for the engine failed (`arrival`)."""
        if self._broken is not None:
            raise EngineBroke(f"{self.engine.name}: the stream broke: {self._broken!r}") from self._broken
        lines = self.response.lines
        if not lines:
            response = self.response
            if not (response.complete and response.rest):
                return []
            lines.append(response.rest)
            response.rest = b""
        events = []
        for line in lines:
            try:
                text = line.decode()
                try:
                    event, end = _scan_once(text, 0)
                except (StopIteration, ValueError):
                    end = -1
                if end != len(text):  # blank, whitespace around it, or not JSON: read (or refused) as json.loads does
                    if not text.strip():
                        continue
                    event = json.loads(text)
            except (ValueError, RecursionError) as error:
                if events:  # the events before it are read first: it stays, after the lines read (its bytes'
                    for _ in range(lines.index(line)):  # first: the same bytes before it would have failed)
                        lines.popleft()
                    return events
                lines.clear()
                if isinstance(error, RecursionError):
                    raise
                raise EngineBroke(f"{self.engine.name}: the stream broke: {error!r}") from error
            events.append(event)
        lines.clear()
        return events

    async def arrival(self) -> None:
        """Waits until more of the answer has arrived (not at all if some did since `arrived` last took it, or the
        answer is complete); a failure (EngineHTTPError) is raised by the next `arrived` as EngineBroke."""
        response = self.response
        if response.lines or response.complete:
            return
        try:
            await response.arrival()
        except EngineHTTPError as error:
            self._broken = error

    async def close(self) -> None:
        self.end()

    def end(self) -> None:
        """Closes the stream (`close` without its coroutine): an answer not read to its end closes its connection,
        which makes the engine abort the request."""
        if self.response is not None:
            self.response.close()


def _refusal(engine: EngineRef, status: int, body: bytes) -> Exception:
    """What a generate answered with an error status means for the gateway."""
    kind, param, _ = _error_fields(body)
    # An engine before the adapter-fault contract refused an unreadable adapter as the request's fault
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
    body = json.dumps(payload, separators=(",", ":")).encode()
    response: Response | None = None
    try:
        async with asyncio.timeout(timeout_s):
            response = await _client().request(
                "POST", f"{engine.url}/v1/generate", headers=_post_headers(engine), body=body, read_timeout=timeout_s
            )
            content = await response.aread()
    except (EngineHTTPError, TimeoutError) as error:
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
    body = json.dumps({**adapter, "tier": tier}).encode()
    try:
        response = await _client().request("POST", f"{engine.url}/v1/adapters/prefetch",
                                           headers=_post_headers(engine), body=body, read_timeout=10.0)  # fmt: skip
        await response.aread()
    except EngineHTTPError:
        pass


async def abort(engine: EngineRef, request_id: str) -> None:
    try:
        response = await _client().request(
            "POST", f"{engine.url}/v1/abort/{request_id}", headers=_headers(engine), read_timeout=2.0
        )
        await response.aread()
    except EngineHTTPError:
        pass  # the engine also aborts when our stream connection closes


def state_sync(*, url: str, token: str, timeout: float = 3.0) -> dict:
    """GET /v1/health then /v1/state (used by the periodic health check, in a worker)."""
    headers = {"Authorization": f"Bearer {token or settings.QUILT_ENGINE_TOKEN}"}
    with httpx.Client(timeout=timeout) as client:
        client.get(f"{url}/v1/health", headers=headers).raise_for_status()
        response = client.get(f"{url}/v1/state", headers=headers)
        response.raise_for_status()
        return response.json()


def prefetch_sync(*, url: str, token: str, adapter: dict, timeout: float = 10.0) -> None:
    headers = {"Authorization": f"Bearer {token or settings.QUILT_ENGINE_TOKEN}"}
    with httpx.Client(timeout=timeout) as client:
        client.post(f"{url}/v1/adapters/prefetch", json=adapter, headers=headers).raise_for_status()
