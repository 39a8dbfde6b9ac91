"""The generate channel's engine side (engine.contract.channel): a gateway process's streamed generates over one
websocket, each served as POST /v1/generate serves it, its answer sent as messages of the request's id."""

import asyncio
import logging
import time

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect

from engine.contract.channel import ChannelHead, channel_message
from engine.server.body_checks import BadRequest
from engine.server.event_stream import LastChunk, ndjson_events
from engine.server.protocol import parse_generate

log = logging.getLogger(__name__)


class RequestId(msgspec.Struct):
    request_id: str | None = None


def request_id_of(raw: bytes) -> str | None:
    """The id a message that failed to parse as a generate gives, if it gives one (its refusal goes to that id)."""
    try:
        request_id = msgspec.json.decode(raw, type=RequestId).request_id
    except msgspec.MsgspecError:
        return None
    return request_id


class GenerateChannel:
    """The websocket route (`session`): every message received is a generate, served in a task of its own; when the gateway
    closes the channel (or goes away), its requests' streams close, which aborts them. `refusal`: an error a request
    can cause -> its HTTP answer (None for any other)."""

    def __init__(self, api, *, refusal):
        self.api = api
        self.refusal = refusal
        self.in_flight: set[asyncio.Task] = set()  # every channel's requests being served now

    async def drained(self, timeout_s: float | None) -> None:
        """Waits (at most `timeout_s`, None: as long as it takes) for the requests in flight on every channel to end: a server's shutdown
        closes websockets at once, which would abort them (called once new requests are refused)."""
        if self.in_flight:
            await asyncio.wait(set(self.in_flight), timeout=timeout_s)

    async def session(self, websocket: WebSocket) -> None:
        await websocket.accept()
        served: set[asyncio.Task] = set()
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    break
                raw = message.get("bytes") or (message.get("text") or "").encode()
                task = asyncio.create_task(self.serve(websocket, raw, time.monotonic()))
                served.add(task)
                self.in_flight.add(task)
                task.add_done_callback(served.discard)
                task.add_done_callback(self.in_flight.discard)
        finally:
            for task in served:
                task.cancel()

    async def serve(self, websocket: WebSocket, raw: bytes, arrival: float) -> None:
        try:
            generate = parse_generate(raw)
            if generate.request_id is None or not generate.stream or generate.kv_transfer is not None:
                raise BadRequest("the channel carries streamed generates with a request_id and no kv_transfer; "
                                 "POST the others to /v1/generate", param="stream")  # fmt: skip
            handle, first = await self.api.started(generate, arrival)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            request_id = request_id_of(raw)
            if request_id is None:
                log.warning("a channel message that is not a generate with its request_id: %r", raw[:200])
                return
            await self.refuse(websocket, request_id, error)
            return
        request_id = generate.request_id
        try:
            refused = self.api.unreadable_adapter(generate, first)
            if refused is not None:
                await websocket.send_bytes(channel_message(ChannelHead(request_id, refused.status_code, True),
                                                           refused.body))  # fmt: skip
                return
            async for chunk in ndjson_events(handle, first, self.api.loop.abort_soon):
                last = type(chunk) is LastChunk
                await websocket.send_bytes(channel_message(ChannelHead(request_id, 200, last), chunk))
        except WebSocketDisconnect:
            pass  # the gateway went away: the stream's end aborted the request

    async def refuse(self, websocket: WebSocket, request_id: str, error: Exception) -> None:
        """The request's refusal, as POST /v1/generate would have answered it (a 500 for an error no request can
        cause, logged)."""
        answer = self.refusal(error)
        if answer is None:
            log.error("the channel failed to serve %s", request_id, exc_info=error)
            body = msgspec.json.encode(
                {"error": {"type": "internal_error", "message": repr(error), "param": None}}
            )
            status = 500
        else:
            body, status = answer.body, answer.status_code
        try:
            await websocket.send_bytes(channel_message(ChannelHead(request_id, status, True), body))
        except WebSocketDisconnect:
            pass
