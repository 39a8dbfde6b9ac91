"""The KV-transfer lease: what a prefill hop answers (`kv_lease`) and a decode hop pulls under (docs/kv-tiers.md).
A lease this side cannot read (a field it does not know, an id that is not hex, another version) is refused by
the struct, naming the field; the gateway then sends the request again without it."""

from typing import Annotated

import msgspec

from engine.contract.version import VERSION, check_version

LEASE_ID_PATTERN = "^[0-9a-f]{16,64}$"
LEASE_TTL_S = (30.0, 600.0)  # kv_transfer prefill: the default and the longest lease

Count = Annotated[int, msgspec.Meta(ge=0)]


class LeaseTransport(msgspec.Struct, forbid_unknown_fields=True):
    """Where the leased blocks are served: "host:port" over TCP (the control channel, and the bytes where nothing
    faster is shared), a shared-memory prefix on the same host, and the source's NIXL agent when it pushes over NIXL
    (the puller's agent metadata goes to it on the control channel)."""

    tcp: str
    shm: str | None = None
    nixl: str | None = None


class KVLease(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    id: Annotated[str, msgspec.Meta(pattern=LEASE_ID_PATTERN)]
    engine_id: str = ""
    transport: LeaseTransport
    num_blocks: Count = 0
    num_tokens: Count = 0
    expires_in_s: float = 0.0
    v: int = VERSION

    def __post_init__(self) -> None:
        check_version("kv lease", self.v)


class PrefillHop(msgspec.Struct, tag_field="mode", tag="prefill", forbid_unknown_fields=True):
    """Compute the prompt's KV and lease its full blocks for `lease_ttl_s` (the answer is one JSON object)."""

    lease_ttl_s: Annotated[float, msgspec.Meta(gt=0, le=LEASE_TTL_S[1])] = LEASE_TTL_S[0]


class DecodeHop(msgspec.Struct, tag_field="mode", tag="decode", forbid_unknown_fields=True):
    """Pull the prompt's blocks under a prefill hop's lease, then serve as usual."""

    lease: KVLease


KVTransfer = PrefillHop | DecodeHop


class PrefillUsage(msgspec.Struct):
    """What a prefill hop cost: the gateway attributes it to the decode engine's usage event (its metadata's prefill)."""

    prompt_tokens: Count = 0
    cached_tokens: Count = 0
    gpu_seconds: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class PrefillAnswer(msgspec.Struct):
    """A prefill hop's 200 answer: the lease the decode hop pulls under, and the hop's usage."""

    kv_lease: KVLease
    usage: PrefillUsage = msgspec.field(default_factory=PrefillUsage)
