"""The engine's HTTP server: uvicorn's httptools protocol, with a response's head held until its first body part and
written with it (one write, one segment, one wake-up of the gateway that reads it), rather than on its own first.

    uvicorn.Config(app, http=EngineHttpProtocol)
    uvicorn ... --http engine.server.http_protocol:EngineHttpProtocol

A streamed generate starts its response once its first event is at hand (`app.EngineAPI.generate`), so holding the
head delays nothing: the head and the first event leave together, and the gateway, which reads both before it
answers its client, wakes once for them instead of twice. The bytes are uvicorn's own (its `send` frames them); only
how many writes carry them changes. A head whose response never sends a body part (a HEAD request, a client gone)
leaves alone when the response ends, or not at all when the client has gone.
"""

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle


class Held:
    """Stands in for a transport while uvicorn's `send` frames a message: what it writes is kept in `parts` (and a
    close in `closing`), for the caller to write in one piece (the gateway's protocol uses it too)."""

    def __init__(self):
        self.parts: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing


class EngineCycle(RequestResponseCycle):
    """uvicorn's request cycle, its response's head written with the first body part."""

    head = b""  # framed, not yet written

    async def send(self, message) -> None:
        started = self.response_started
        if started and not self.head:
            await super().send(message)
            return
        transport, held = self.transport, Held()
        self.transport = held  # uvicorn's send frames the message into `held`
        try:
            await super().send(message)
        finally:
            self.transport = transport
            data = b"".join([self.head, *held.parts])
            if not started and self.response_started and not held.closing and not self.response_complete:
                self.head = data  # the head alone: it waits for the first body part
            else:
                self.head = b""
                if data and not self.disconnected:
                    transport.write(data)
                if held.closing:
                    transport.close()


class EngineHttpProtocol(HttpToolsProtocol):
    def on_headers_complete(self) -> None:
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before:  # a request cycle was made (not an upgrade); its task has not run yet
            self.cycle.__class__ = EngineCycle  # adds a method and a class attribute only: the same instance layout
