"""The prefill hop of disaggregated serving (docs/kv-tiers.md, "Disaggregated serving"; the wire contract is the
engine's): the gateway asks a prefill engine to compute a prompt's KV and pin it under a lease, then sends the
usual request, with the lease, to the engine that decodes it, which pulls the blocks.

    prefill hop   POST /v1/generate  {the usual body, "stream": false,
                                      "kv_transfer": {"mode": "prefill", "lease_ttl_s": TTL}}
                  200 {"kv_lease": {"id", "engine_id", "transport": {...}, "num_blocks", "num_tokens", "expires_in_s"},
                       "usage": {"prompt_tokens", "cached_tokens", "gpu_seconds"}}
    decode hop    the usual body (streamed as the client asked) + "kv_transfer": {"mode": "decode", "lease": kv_lease}

The prefill hop is an optimisation: whatever goes wrong with it (unreachable, timed out, refused, an answer without
a lease), the request is served whole by the engine chosen to decode it, and the failure is logged and counted
(`quilt_gateway_prefill_fallbacks_total{reason}`). So is a decode engine's refusal of the lease (an engine of
another version): the request is sent again, without it (reason `decode_refused`). A lease nobody pulled (the
decode engine recomputed, or refused it) is ended on the prefill engine at once (`end_lease`). A refusal of the request itself (its prompt past the context, a
field out of range) is no failure of the hop: the decode engine would refuse it alike, so it is the client's 400 at
once, counted as the route `refused`.

A hop's GPU time travels in the request's metadata (`"prefill": {"engine", "gpu_ms", "cached_tokens"}`), which the
decode engine's usage event echoes back, so metering costs it at the prefill engine's price; the cached tokens
billed are the prefill engine's (engine.contract.billed_cached_tokens), the same rule in the client's usage and in
metering."""

import asyncio
import logging
import time
from dataclasses import dataclass

import msgspec

from engine.contract import KVLease, PrefillShare
from engine.contract.kv import PrefillAnswer
from gateway import engine_client, metrics
from gateway.engine_client import AdapterUnavailable, EngineRef, EngineRejected, EngineUnavailable

log = logging.getLogger(__name__)

_background: set[asyncio.Task] = set()  # aborts and prefetches sent without waiting (kept until they end)


@dataclass(frozen=True)
class PrefillHop:
    """A prefill hop that answered: the lease for the decode engine, and what it cost."""

    engine: EngineRef
    lease: KVLease
    gpu_ms: float
    prompt_tokens: int
    cached_tokens: int

    def attribution(self) -> PrefillShare:
        """The request metadata's `prefill` entry: whose GPU time, and how much (metering prices it), and the prompt
        tokens the prefill engine found cached (what the request is billed as cached: engine.contract.billed_cached_tokens)."""
        return PrefillShare(engine=self.engine.name, gpu_ms=round(self.gpu_ms, 3), cached_tokens=self.cached_tokens)


class PrefillFailed(Exception):
    """The prefill hop gave no usable lease; `reason` labels the fallback metric."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def prefill_payload(payload: dict, *, lease_ttl_s: int) -> dict:
    return payload | {"stream": False, "kv_transfer": {"mode": "prefill", "lease_ttl_s": lease_ttl_s}}


def decode_payload(payload: dict, hop: PrefillHop) -> dict:
    return payload | {"kv_transfer": {"mode": "decode", "lease": hop.lease}}


def hop_read(engine: EngineRef, answer: dict) -> PrefillHop:
    """The prefill engine's answer, read by the contract's struct (engine.contract.kv.PrefillAnswer)."""
    try:
        read = msgspec.convert(answer, PrefillAnswer)
    except msgspec.ValidationError as error:
        raise PrefillFailed("bad_answer", f"{engine.name} answered the prefill hop without a usable lease: {error}") \
            from None  # fmt: skip
    usage = read.usage
    if not usage.gpu_seconds:
        log.warning("prefill hop on %s reported no GPU time: its share goes unattributed", engine.name)
    return PrefillHop(engine=engine, lease=read.kv_lease, gpu_ms=usage.gpu_seconds * 1000.0,
                      prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens)  # fmt: skip


async def prefill_hop(engine: EngineRef, payload: dict, *, request_id: str, timeout_s: float) -> PrefillHop:
    """Runs the prefill hop on `engine`; PrefillFailed if it gives no lease. A client that leaves meanwhile
    (cancellation) aborts it on the engine, which then releases what it pinned."""
    started = time.monotonic()
    try:
        answer = await engine_client.generate_whole(engine, payload, timeout_s=timeout_s)
    except asyncio.CancelledError:
        _spawn(engine_client.abort(engine, request_id))
        raise
    except EngineUnavailable as error:
        timed_out = isinstance(error.__cause__, TimeoutError)
        if timed_out:
            _spawn(engine_client.abort(engine, request_id))
        raise PrefillFailed("timeout" if timed_out else "unavailable", str(error)) from error
    except AdapterUnavailable as error:
        raise PrefillFailed("adapter_unavailable", str(error)) from error
    except EngineRejected as rejected:
        if refuses_the_request(rejected):
            raise  # the decode engine checks the request as the prefill engine does: the client hears it now
        raise PrefillFailed("refused", f"{engine.name}: {rejected.status} {rejected.message}") from rejected
    hop = hop_read(engine, answer)
    metrics.prefill_seconds.observe(time.monotonic() - started)
    return hop


def refuses_the_request(rejected: EngineRejected) -> bool:
    """Whether an engine's 4xx to a hop is about the client's request itself (a prompt past the context, a bad
    field), which every engine refuses alike, rather than about the hop (its `kv_transfer`, or `metadata` an older
    engine does not take): the former is the client's answer, not a fallback. An engine names a field by its path
    (`kv_transfer.lease.transport.tcp`); one of the previous version names some by their last part only (`ttl`), so a
    message about `kv_transfer` is the hop's too: a client cannot send that field."""
    hop_fields = ("kv_transfer", "metadata")
    if rejected.code == "context_length_exceeded":
        return True
    if "kv_transfer" in rejected.message:
        return False
    return rejected.param is not None and not rejected.param.startswith(hop_fields)


def end_lease(hop: PrefillHop, request_id: str) -> None:
    """Ends the hop's lease on the prefill engine now, if nobody pulled it (the decode engine recomputed, or refused
    the lease): the engine's abort of a prefill hop that has ended releases its unpulled lease, instead of holding its
    blocks until the TTL. A lease that was pulled is untouched (the abort then finds nothing)."""
    _spawn(engine_client.abort(hop.engine, request_id))


def prefetch_soon(engine: EngineRef, *, adapter: dict) -> None:
    """Warms the adapter (the generate request's "adapter") on the decode engine while the prefill engine computes
    (it is loaded there anyway when the decode hop arrives: the same ensure path as every request)."""
    _spawn(engine_client.prefetch(engine, adapter=adapter))


def _spawn(coroutine) -> None:
    task = asyncio.get_running_loop().create_task(coroutine)
    _background.add(task)
    task.add_done_callback(_background.discard)
