"""The engine <-> gateway <-> metering contract: every message that crosses a process boundary, as one msgspec
Struct each, in torch-free, Django-free modules every side imports. Each message carries the contract's version
`v` (the stream's, in its final event); a message of another version is refused, naming it (WrongVersion), never
read as if it were this one.

    generate.py      GenerateRequest, what the gateway POSTs to an engine's /v1/generate (with its AdapterRef)
    kv.py            KVLease, a prefill hop's answer and a decode hop's kv_transfer (PrefillHop | DecodeHop)
    events.py        the generate stream's Delta and Final events (StreamEvent), tagged by "type"
    usage.py         UsageEvent, sent as Celery task TASK_NAME ([events]), recorded at most once per request id
    fingerprints.py  prompt_fingerprints(): the gateway routes on them, the engine's heartbeat reports those it served
    adapter fault    error_type ADAPTER_UNAVAILABLE: in the final event, or as the HTTP 503 answer's
                     {"error": {"type": ADAPTER_UNAVAILABLE, "message", "param": "adapter"}}; only that request
                     fails, the engine stays healthy
    state.py         EngineState (a heartbeat's `state`, the head of /v1/state's StateAnswer), its adapter residency
                     (Adapters, AdapterResidency) and the Heartbeat; state_read() refuses one it cannot read (BadState)
    channel.py       the generate channel: one websocket per gateway process and engine for its streamed generates
                     (EngineState.channel names its path where an engine serves one)
"""

from engine.contract.events import EVENT_DELTA, EVENT_FINAL, Delta, Final, StreamEvent
from engine.contract.fingerprints import PREFIX_CHUNK_CHARS, prompt_fingerprints
from engine.contract.generate import ADAPTER_FILES, KEEP_ALIVE_SECONDS, AdapterRef, GenerateRequest
from engine.contract.kv import KVLease
from engine.contract.state import (
    AdapterResidency,
    Adapters,
    BadState,
    EngineState,
    Heartbeat,
    StateAnswer,
    state_builtins,
    state_read,
)
from engine.contract.usage import (
    FINISH_REASONS,
    TASK_NAME,
    BadUsageEvent,
    PrefillShare,
    UsageEvent,
    UsageMetadata,
    billed_cached_tokens,
    now_utc,
    usage_event_read,
)
from engine.contract.version import VERSION, WrongVersion

__all__ = [
    "ADAPTER_FILES", "ADAPTER_UNAVAILABLE", "CONTEXT_LENGTH_EXCEEDED", "EVENT_DELTA", "EVENT_FINAL", "FINISH_REASONS",
    "KEEP_ALIVE_SECONDS", "PREFIX_CHUNK_CHARS", "TASK_NAME", "VERSION", "AdapterRef", "AdapterResidency", "Adapters",
    "BadState", "BadUsageEvent", "Delta", "EngineState", "Final", "GenerateRequest", "Heartbeat", "KVLease",
    "PrefillShare", "StateAnswer", "StreamEvent", "UsageEvent", "UsageMetadata", "WrongVersion",
    "billed_cached_tokens", "now_utc", "prompt_fingerprints", "state_builtins", "state_read", "usage_event_read",
]  # fmt: skip

ADAPTER_UNAVAILABLE = "adapter_unavailable"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for a request past the model's context
