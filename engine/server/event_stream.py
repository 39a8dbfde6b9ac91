"""A streamed generate on the wire: its events as NDJSON, those already waiting in one chunk, and the final event's
chunk written with the chunked response's end (`EventStream`). Each write the engine saves is a read, and often a
wake-up, fewer in the gateway that reads the stream (docs/gateway-cpu.md)."""

from collections.abc import AsyncIterator, Callable

import msgspec
from starlette.responses import StreamingResponse

from engine.contract.events import StreamEvent
from engine.server.engine_loop import RequestHandle
from engine.server.events import delta_event, final_event


async def ndjson_events(handle: RequestHandle, first: tuple, abandoned: Callable[[str], None]) -> AsyncIterator[bytes]:
    """A streamed request's events as NDJSON lines, from its `first` queue item on: the items already waiting
    joined in one chunk (one write; nothing waits for an item that has not come), the chunk with the final event a
    `LastChunk` (for `EventStream`). `abandoned(request_id)` if the stream is closed before its end (the client went
    away)."""
    sent: dict[int, int] = {}
    ended = False
    events = handle.events
    try:
        while True:
            lines = []
            kind, item = first if first is not None else await events.get()
            first = None
            while True:
                if kind == "end":
                    ended = True
                    lines.append(ndjson(final_event(handle, item)))
                    break
                event = delta_event(handle, item, sent)
                if event is not None:
                    lines.append(ndjson(event))
                if events.empty():
                    break
                kind, item = events.get_nowait()
            if ended:
                yield LastChunk(b"".join(lines))
                return
            if lines:
                yield b"".join(lines)
    finally:
        if not ended:
            abandoned(handle.request_id)


class LastChunk(bytes):
    """A stream's last chunk: `EventStream` sends it as the response's last body part."""


class EventStream(StreamingResponse):
    """A streamed generate's NDJSON: its last chunk (`LastChunk`, the final event's) leaves with the chunked
    response's end in one write, not followed by the end in a write of its own (which the gateway, reading the
    response to its end before it answers its client's last chunk, would wake for again)."""

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for chunk in self.body_iterator:
            ended = type(chunk) is LastChunk
            await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


_encode = msgspec.json.Encoder().encode


def ndjson(event: StreamEvent) -> bytes:
    return _encode(event) + b"\n"
