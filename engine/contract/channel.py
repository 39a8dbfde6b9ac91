"""The generate channel: one websocket from a gateway process to an engine (`CHANNEL_PATH`) that carries all its
streamed generates, so that a request costs one message each way instead of an HTTP exchange (the gateway's CPU per
request: docs/gateway-cpu.md, "The request path").

Gateway -> engine: each binary message is one GenerateRequest (`stream` true, a `request_id`, no `kv_transfer`: the
hops of disaggregated serving and whole answers stay on POST /v1/generate). Engine -> gateway: each binary message is
a `ChannelHead` line, then either the request's next NDJSON events (status 200; the events that were waiting
together, as the HTTP stream's chunk) or, when the engine refused the request, the body of the HTTP error it would
have answered (its status in the head). `last` marks a request's last message. An abort is POST /v1/abort, as on
HTTP; when the channel closes the engine aborts every request it carried."""

import msgspec

from engine.contract.version import VERSION, check_version

CHANNEL_PATH = "/v1/channel"
CHANNEL_MAX_BYTES = 16 * 2**20  # the largest message an engine takes on it (a larger generate is POSTed)


class ChannelHead(msgspec.Struct, array_like=True, frozen=True):
    """What an engine -> gateway message carries for `request_id`: an HTTP status (200: events follow) and whether
    it is the request's last."""

    request_id: str
    status: int = 200
    last: bool = False
    v: int = VERSION

    def __post_init__(self) -> None:
        check_version("channel message", self.v)


_encode = msgspec.json.Encoder().encode
_decode_head = msgspec.json.Decoder(ChannelHead).decode


def channel_message(head: ChannelHead, body: bytes) -> bytes:
    """An engine -> gateway message: the head's line, then `body` (NDJSON events, or an error's JSON)."""
    return _encode(head) + b"\n" + body


def channel_read(message: bytes) -> tuple[ChannelHead, bytes]:
    """An engine -> gateway message's head and body; msgspec.ValidationError (or WrongVersion) if the head is not
    this contract's."""
    head, _, body = message.partition(b"\n")
    return _decode_head(head), body
