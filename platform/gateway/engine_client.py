"""Talking to an engine's internal HTTP API: from the gateway's event loop through `engine_http` (one pool of
keep-alive connections per loop), from the worker's blocking code through httpx."""

import asyncio
import functools
import json
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from django.conf import settings

from engine.contract import ADAPTER_UNAVAILABLE, EVENT_FINAL
from gateway.engine_http import EngineHTTP, EngineHTTPError, Response, prepared
from gateway.hot_settings import hot
from gateway.running_loop import running_loop


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
_decode = json.JSONDecoder().raw_decode  # an event line as the engine writes it, without json.loads' two wrappers


_last: tuple[object, EngineHTTP | None] = (None, None)  # the loop a request was last sent from, and its client


def _client() -> EngineHTTP:
    global _last
    loop = running_loop()
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
    """An open generate stream. `open()` raises EngineUnavailable / EngineRejected before any event;
    iterating yields the engine's events and raises EngineBroke if the stream dies unfinished."""

    def __init__(self, engine: EngineRef, payload: dict):
        self.engine = engine
        self.payload = payload
        self._response: Response | None = None
        self.finished = False

    async def open(self) -> "GenerateStream":
        address, head, rest = _generate_request(self.engine.url, self.engine.token or hot.QUILT_ENGINE_TOKEN)
        body = "".join(_compact_chunks(self.payload, 0)).encode()
        last_loop, client = _last  # `_client()` when it is the last request's loop, without its call
        if last_loop is not running_loop():
            client = _client()
        try:
            self._response = await client.send(address, b"%b%d%b%b" % (head, len(body), rest, body))
        except EngineHTTPError as error:
            raise EngineUnavailable(f"{self.engine.name}: {error}") from error
        status = self._response.status
        if status >= 400:
            try:
                body = await self._response.aread()
            except EngineHTTPError:
                body = b""
            self._response.close()
            raise _refusal(self.engine, status, body)
        return self

    async def events(self) -> AsyncIterator[dict]:
        response = self._response
        assert response is not None
        lines = response.lines
        try:
            while True:
                if lines:
                    line = lines.popleft().decode()
                elif not response.complete:
                    await response.arrival()
                    continue
                elif response.rest:  # the last line, unterminated
                    line, response.rest = response.rest.decode(), b""
                else:
                    break
                if not line.strip():
                    continue
                try:
                    event, end = _decode(line)
                except ValueError:
                    end = -1
                if end != len(line):  # whitespace around it, or not JSON: read (or refused) as json.loads does
                    event = json.loads(line)
                if event.get("type") == EVENT_FINAL:
                    self.finished = True  # read on to the body's end: the connection then goes back to the pool
                yield event
        except (EngineHTTPError, ValueError) as error:
            raise EngineBroke(f"{self.engine.name}: the stream broke: {error!r}") from error
        if not self.finished:
            raise EngineBroke(f"{self.engine.name}: the stream ended before the request finished")

    def event_ready(self) -> bool:
        """Whether the next event has arrived already (iterating would not wait for the engine)."""
        return self._response is not None and self._response.line_ready()

    async def close(self) -> None:
        if self._response is not None:
            self._response.close()


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


async def prefetch(engine: EngineRef, *, digest: str, path: str, tier: str = "gpu") -> None:
    """Asks the engine to load an adapter ahead of a request (POST /v1/adapters/prefetch); a failure only means
    the request that follows loads it itself."""
    body = json.dumps({"digest": digest, "path": path, "tier": tier}).encode()
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


def prefetch_sync(*, url: str, token: str, digest: str, path: str, timeout: float = 10.0) -> None:
    headers = {"Authorization": f"Bearer {token or settings.QUILT_ENGINE_TOKEN}"}
    with httpx.Client(timeout=timeout) as client:
        client.post(f"{url}/v1/adapters/prefetch", json={"digest": digest, "path": path}, headers=headers).raise_for_status()
