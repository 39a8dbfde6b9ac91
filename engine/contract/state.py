"""The engine's state: what it reports of itself to the fleet, in each heartbeat (`Heartbeat.state`) and in the
head of its `GET /v1/state` answer (`StateAnswer`, which adds what an operator reads). The gateway routes on it
(capacity, load, KV and page use, which adapters sit where and how long their moves take, the prompt fingerprints it
served); the console's engine page shows it. An outside router reads the same JSON (docs/residency.md).

Adapter residency (`Adapters`): the device tier's digests (`gpu`, named so on CPU too), host memory's, those being
read from disk (`loading`) or copied into pages (`placing`), those running requests use (`in_use`), the pins
(`pinned`: digest -> "device" | "host"), one `AdapterResidency` per adapter and memory tier (the entries of
`quilt_engine_adapter_resident{adapter, tier, pinned, rank}`), and the running mean of each kind of move the engine
timed (`load_seconds`, the moves `quilt_engine_adapter_load_seconds` observes).

A state this side cannot read (a field missing or of the wrong type, another version) is refused by `state_read`,
naming the field or the version: the gateway then holds that engine unhealthy, never reads it as another shape."""

from typing import Annotated, Any, Literal

import msgspec

from engine.contract.generate import Digest
from engine.contract.version import VERSION, WrongVersion, check_version, version_of

ROLES = ("prefill", "decode", "both")  # an engine's role (python -m engine --role); "both" serves whole requests
FINGERPRINT_PATTERN = "^[0-9a-f]{16}$"  # engine.contract.prompt_fingerprints' (8-byte blake2b, hex)

Count = Annotated[int, msgspec.Meta(ge=0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Share = Annotated[float, msgspec.Meta(ge=0, le=1)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]
Role = Literal["prefill", "decode", "both"]
Tier = Literal["device", "host"]
Fingerprint = Annotated[str, msgspec.Meta(pattern=FINGERPRINT_PATTERN)]


class AdapterResidency(msgspec.Struct, frozen=True):
    """One adapter in one memory tier."""

    digest: Digest
    tier: Tier
    pinned: bool  # pinned always-warm in this tier: never evicted from it
    rank: Count  # its largest module rank


class LoadSeconds(msgspec.Struct, omit_defaults=True):
    """The running mean of each kind of move the engine timed; None: none of that kind yet."""

    disk_host: Seconds | None = None  # read, checked and laid out in host memory
    host_device: Seconds | None = None  # copied into device pages


class Adapters(msgspec.Struct, kw_only=True):
    gpu: list[Digest]  # the device tier
    host: list[Digest]  # host memory (an adapter on the device keeps its copy here too)
    loading: list[Digest]  # being read from disk
    placing: list[Digest]  # pages taken, the copy into them under way
    in_use: list[Digest]  # on the device, and a running request uses it
    pinned: dict[Digest, Tier]
    residency: list[AdapterResidency]  # device entries first
    load_seconds: LoadSeconds
    failed: dict[Digest, str]  # loads that failed, and why, until the adapter is asked for again
    registered: Count  # adapters whose files the engine knows where to read
    host_bytes: Count
    device_pages: Count  # pages the device tier holds


class PoolCounts(msgspec.Struct, kw_only=True):
    """The page pool's own counts: free + evictable + in_use + adapter_pages == total; `held` (blocks held outside
    any sequence: by leases, imports, transfers) is part of in_use."""

    total: Count
    free: Count
    evictable: Count  # prefix-cached blocks no sequence uses: free to take, hits until taken
    in_use: Count
    held: Count
    adapter_pages: Count


class Memory(msgspec.Struct, kw_only=True):
    """The accelerator memory's split: base weights, then one page pool shared by KV and adapters (docs/engine-memory.md)."""

    page_bytes: Count
    pages_total: Count
    base_weights_bytes: Count
    kv_pages_bytes: Count
    adapter_pages_bytes: Count
    free_bytes: Count  # prefix-cached blocks included
    quantization: str
    kv_cache_dtype: str
    base_weights_full_precision_bytes: Count
    kv_bytes_per_token: NonNegative
    kv_bytes_per_token_full_precision: NonNegative
    kv_capacity_tokens: Count
    kv_capacity_tokens_full_precision: Count


class EngineState(msgspec.Struct, kw_only=True):
    """What routing and the console read of an engine (the heartbeat's `state`, the head of /v1/state)."""

    model: str
    role: Role
    accepting: bool  # False while it drains: new requests get 503
    capacity: Annotated[int, msgspec.Meta(ge=1)]  # requests it runs at once (max_num_seqs)
    running: Count
    waiting: Count
    kv_blocks_used: Count  # pages holding KV
    kv_blocks_free: Count  # pages free to take, prefix-cached ones included (adapters take them too)
    kv_blocks_total: Count
    kv_pool: PoolCounts
    prefix_cache_hit_rate: Share
    busy_ms: NonNegative
    steps: Count
    preemptions: Count
    tokens_per_second: NonNegative
    memory: Memory
    adapters: Adapters
    prefixes: list[Fingerprint]  # the prompt fingerprints of what it served lately, most recent first
    request_seconds: Seconds | None = None  # the running mean of the time a sequence holds a slot (first step to
    # finish): routing's queue wait; None until one has finished
    channel: str | None = None  # the path of its generate channel (engine.contract.channel); None: it serves none
    v: int = VERSION

    def __post_init__(self) -> None:
        check_version("engine state", self.v)

    @property
    def load(self) -> int:
        """Requests running and waiting on the engine."""
        return self.running + self.waiting

    def resident_digests(self) -> frozenset[str]:
        """Adapters in its device or host tier, or being read into it."""
        adapters = self.adapters
        return frozenset((*adapters.gpu, *adapters.host, *adapters.loading))


class RequestOnEngine(msgspec.Struct, omit_defaults=True):
    request_id: str
    index: int
    tenant: str
    adapter: str | None
    completion_tokens: Count | None = None  # running requests only


class LastStep(msgspec.Struct, kw_only=True):
    sequences: Count
    adapters: list[str]
    new_tokens: Count = 0
    ms: NonNegative = 0.0


class StateAnswer(EngineState, kw_only=True):
    """GET /v1/state: the state, and what an operator reads of the engine's insides (free-form sections: their
    parts' docs say what they hold)."""

    running_requests: list[RequestOnEngine]
    waiting_requests: list[RequestOnEngine]
    steps_per_second: NonNegative
    last_step: LastStep
    tensor_parallel_size: Annotated[int, msgspec.Meta(ge=1)]
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    kv_pulls_in_flight: Count  # decode hops pulling their KV now
    kv_tiers: dict[str, dict[str, Any]]  # docs/kv-tiers.md
    kv_leases: dict[str, Any]  # docs/kv-tiers.md
    speculation: dict[str, Any]  # docs/speculative.md
    grammars: dict[str, Any]  # docs/structured-output.md


class Heartbeat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST {control_plane}/internal/engines/heartbeat (docs/fleet.md)."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=100)]
    url: Annotated[str, msgspec.Meta(min_length=1)]  # where gateways reach the engine
    pool: Annotated[str, msgspec.Meta(min_length=1)] = "default"
    gpu_price_per_hour: str = "0"  # a decimal number
    interval_s: Annotated[float, msgspec.Meta(gt=0)]  # seconds to the next heartbeat
    draining: bool = False  # leaving: out of routing at once
    state: EngineState
    v: int = VERSION

    def __post_init__(self) -> None:
        check_version("heartbeat", self.v)


class BadState(ValueError):
    """An engine's state (or heartbeat) this side cannot read: the message names the field."""


def state_read(data: object, kind: type[EngineState] | type[Heartbeat] = EngineState) -> Any:
    """An EngineState (or another `kind`) from decoded JSON; WrongVersion for another version, else BadState naming
    the field."""
    name = "heartbeat" if kind is Heartbeat else "engine state"
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as error:
        version = version_of(data)
        nested = data.get("state") if kind is Heartbeat and isinstance(data, dict) else None
        if version == VERSION and version_of(nested) != VERSION:  # a heartbeat of this version, its state not
            version, name = version_of(nested), "engine state"
        if version != VERSION:
            raise WrongVersion(name, version) from None
        raise BadState(f"{name}: {error}") from None


def state_builtins(state: EngineState) -> dict:
    """The state as plain JSON (what the control plane stores per engine)."""
    return msgspec.to_builtins(state)
