"""The generate channel's gateway side (engine.contract.channel): per event loop and engine, one websocket through
aiohttp that carries every streamed generate to that engine. A request costs one message out and one in per chunk
of its events, where an HTTP exchange costs a request's and a response's parsing, a connection taken from the pool
and given back, and timers of its own (the gateway's CPU per request: docs/gateway-cpu.md, "The request path").

A request's messages are read into its `ChannelBody`, which reads as engine_client.Body reads an HTTP answer. When
the channel closes (the engine went away or restarted), every request it carried breaks; the next request opens a
new channel."""

import asyncio
import collections
import weakref

import aiohttp
import msgspec

from engine.contract.channel import ChannelHead, channel_read


class ChannelLost(aiohttp.ClientConnectionError):
    """The channel closed, or failed, before the request's last message."""


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class ChannelBody:
    """One request's answer on the channel as it arrives: `lines` holds the event lines not yet taken (popleft them),
    `complete` is set by its last message; `rest` is always empty (a message holds whole lines). A refusal sets
    `status` (the engine's HTTP status) and `error` (its body). `arrival()` waits for more; it raises ChannelLost
    once the channel is gone, asyncio.TimeoutError after `read_timeout` seconds without a message."""

    rest = b""
    complete = False
    status = 200
    error = b""

    def __init__(self, channel: "EngineChannel", request_id: str, read_timeout: float):
        self.channel = channel
        self.request_id = request_id
        self.read_timeout = read_timeout
        self.lines: collections.deque[bytes] = collections.deque()
        self.lost: ChannelLost | None = None
        self.waiter: asyncio.Future | None = None

    def arrived(self, head: ChannelHead, body: bytes) -> None:
        if head.status != 200:
            self.status, self.error = head.status, body
        else:
            lines = body.split(b"\n")
            if not lines[-1]:
                lines.pop()
            self.lines += lines
        self.complete = head.last or head.status != 200
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def broke(self, lost: ChannelLost) -> None:
        self.lost = lost
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def arrival(self) -> None:
        if not (self.lines or self.complete or self.lost):
            loop = self.channel.loop
            self.waiter = waiter = loop.create_future()
            timer = loop.call_later(self.read_timeout, _expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self.waiter = None
        if self.lost is not None and not self.lines and not self.complete:
            raise self.lost

    def close(self) -> None:
        """Ends the exchange: later messages for the request are dropped (an unfinished request is aborted by
        POST /v1/abort, as on HTTP)."""
        self.channel.bodies.pop(self.request_id, None)


class EngineChannel:
    """An open channel: its websocket, the bodies of the requests it carries (by request id) and the task that reads
    its messages into them."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, key: tuple, channels: dict):
        self.ws = ws
        self.key = key
        self.channels = channels  # the loop's channels, which this one leaves when it closes
        self.bodies: dict[str, ChannelBody] = {}
        self.open = True
        self.loop = asyncio.get_running_loop()
        self.reader = self.loop.create_task(self._read())

    async def send(self, request_id: str, data: bytes, *, read_timeout: float) -> ChannelBody:
        """Sends a generate (`data`, its JSON) and gives the body its answer arrives in; a ClientConnectionError if the
        channel is closed."""
        if not self.open:
            raise ChannelLost("the channel is closed")
        body = self.bodies[request_id] = ChannelBody(self, request_id, read_timeout)
        try:
            await self.ws.send_bytes(data)
        except BaseException:
            self.bodies.pop(request_id, None)
            raise
        return body

    async def _read(self) -> None:
        lost = ChannelLost("the engine closed the channel")
        bodies = self.bodies
        try:
            while True:
                message = await self.ws.receive()
                if message.type is aiohttp.WSMsgType.BINARY:
                    head, body = channel_read(message.data)
                    target = bodies.get(head.request_id)
                    if target is not None:
                        target.arrived(head, body)
                elif message.type is not aiohttp.WSMsgType.TEXT:  # CLOSE, CLOSING, CLOSED, ERROR
                    if message.type is aiohttp.WSMsgType.ERROR:
                        lost = ChannelLost(f"the channel failed: {message.data!r}")
                    break
        except msgspec.MsgspecError as error:
            lost = ChannelLost(f"a message that is not the channel's: {error}")
        except aiohttp.ClientError as error:
            lost = ChannelLost(f"the channel failed: {error!r}")
        finally:
            self.open = False
            if self.channels.get(self.key) is self:
                del self.channels[self.key]
            for body in bodies.values():
                body.broke(lost)
            bodies.clear()
        await self.ws.close()


# each event loop's channels, by (engine URL, channel path, token): an open one, or the connect under way
_channels: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict]" = weakref.WeakKeyDictionary()


async def channel_to(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], key: tuple
) -> EngineChannel:
    """The running loop's channel for `key`, opened at `url` (a ClientError if it cannot be): one connect at a time,
    which every request that needs the channel meanwhile waits for."""
    loop = asyncio.get_running_loop()
    channels = _channels.get(loop)
    if channels is None:
        channels = _channels[loop] = {}
    found = channels.get(key)
    if found is not None:
        if found.__class__ is EngineChannel:
            if found.open:
                return found
        else:
            try:
                return await asyncio.shield(found)
            except asyncio.CancelledError:
                if found.cancelled():  # the request that was connecting was cancelled: not this one
                    raise ChannelLost("the channel's connect was cancelled") from None
                raise
    connecting = channels[key] = loop.create_future()
    try:
        ws = await session.ws_connect(url, headers=headers, autoping=True, max_msg_size=0, compress=0)
    except BaseException as error:
        if channels.get(key) is connecting:
            del channels[key]
        if isinstance(error, asyncio.CancelledError):
            connecting.cancel()
        else:
            connecting.set_exception(error)
            connecting.exception()  # retrieved: those who waited have it raised
        raise
    channel = channels[key] = EngineChannel(ws, key, channels)
    connecting.set_result(channel)
    return channel
