"""The engine <-> gateway contract, in one torch-free module both sides import (the platform may import it; it
imports neither torch nor Django): the usage event, the generate stream's event kinds and error types, and how
to read an engine's /v1/state.

    usage event      engine.usage.event.UsageEvent, sent as Celery task TASK_NAME ([event dicts]), at most once
                     recorded per request id
    generate stream  NDJSON lines {"type": EVENT_DELTA, ...} then one {"type": EVENT_FINAL, "finish_reason",
                     "error", "error_type", "choices", "usage"}; finish_reason in FINISH_REASONS
    adapter          the generate request's "adapter": a digest, or {"digest", "path"} (a folder the engine reads), or
                     {"digest", "urls": {file name: signed GET URL}} (remote storage: the engine downloads the canonical
                     files, ADAPTER_FILES, into its disk cache and checks them)
    adapter fault    error_type ADAPTER_UNAVAILABLE: in the final event, or as the HTTP 503 answer's
                     {"error": {"type": ADAPTER_UNAVAILABLE, "message", "param": "adapter"}}; only that request
                     fails, the engine stays healthy
    fingerprints     prompt_fingerprints(): the gateway routes on them, the engine's heartbeat reports those it served
    /v1/state        {"model", "running", "waiting", "adapters": {tier: [{"digest", ...} | digest, ...]}, ...}
    disaggregated    the gateway's request metadata `"prefill": {"engine", "gpu_ms", "cached_tokens"}` (the prefill hop's
                     engine, its GPU time and prefix hits), echoed in the decode engine's usage event; the cached
                     tokens billed are billed_cached_tokens() (docs/kv-tiers.md)
    keep-alive       the engine server keeps an idle connection open KEEP_ALIVE_SECONDS after an answer's end; a
                     client reuses one for less (the gateway: 2 s), so the engine never closes it under a request
"""

import hashlib
import json

from engine.usage.event import FINISH_REASONS, SCHEMA_VERSION, TASK_NAME, UsageEvent

__all__ = [
    "ADAPTER_FILES", "ADAPTER_UNAVAILABLE", "CONTEXT_LENGTH_EXCEEDED", "EVENT_DELTA", "EVENT_FINAL", "FINISH_REASONS", "KEEP_ALIVE_SECONDS", "SCHEMA_VERSION", "TASK_NAME",
    "UsageEvent", "billed_cached_tokens", "prompt_fingerprints", "state_load", "state_resident_digests",
]  # fmt: skip

ADAPTER_FILES = ("quilt_adapter.json", "adapter_model.safetensors")  # what an engine downloads of an adapter
EVENT_DELTA = "delta"
EVENT_FINAL = "final"
ADAPTER_UNAVAILABLE = "adapter_unavailable"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for a request past the model's context
PREFIX_CHUNK_CHARS = 256  # a prompt fingerprint covers each whole chunk of this many characters of the prompt
PREFIX_MAX_CHUNKS = 16  # 4 KiB of prompt: system prompts and few-shot preambles, the prefixes worth routing on
KEEP_ALIVE_SECONDS = 75  # as the gateway's own server: longer than load balancers and clients keep idle connections


def billed_cached_tokens(*, decode_cached: int, prefill_cached: int) -> int:
    """A disaggregated request is billed as if one engine had served it: the blocks the decode engine pulled from
    the lease were computed for this very request, so they are no cache hit for the tenant. Its cached tokens are
    the prefill engine's prefix hits, never more than the decode engine counted (if the pull failed and it
    recomputed, its own hits)."""
    return min(decode_cached, prefill_cached)


def state_resident_digests(state: dict) -> frozenset[str]:
    """Adapter digests in any tier of an engine's /v1/state answer."""
    found: set[str] = set()
    tiers = state.get("adapters") or state.get("resident_adapters") or {}
    for value in tiers.values() if isinstance(tiers, dict) else [tiers]:
        for item in value if isinstance(value, list) else []:
            digest = item.get("digest") if isinstance(item, dict) else item
            if isinstance(digest, str):
                found.add(digest)
    return frozenset(found)


def state_load(state: dict) -> int:
    """Requests running and waiting on the engine, from its /v1/state answer."""
    return int(state.get("running", 0) or 0) + int(state.get("waiting", 0) or 0)


def prompt_fingerprints(*, tenant: str, adapter: str | None, prompt: str | None = None,
                        messages: list | None = None) -> list[str]:
    """Chained hashes of the prompt's whole PREFIX_CHUNK_CHARS-character chunks, scoped to the tenant and the
    adapter (as the engine's KV prefix cache is: LoRA on k/v changes the cache, and a shared cache would let one
    tenant time-probe another's prompts). The engine records those of what it serves; its heartbeat carries them."""
    text = prompt if messages is None else json.dumps(messages, sort_keys=True, separators=(",", ":"))
    if not isinstance(text, str):
        return []
    chunks = min(len(text) // PREFIX_CHUNK_CHARS, PREFIX_MAX_CHUNKS)
    fingerprints = []
    previous = f"{tenant}\x00{adapter or ''}".encode()
    for k in range(chunks):
        chunk = text[k * PREFIX_CHUNK_CHARS:(k + 1) * PREFIX_CHUNK_CHARS].encode()
        previous = hashlib.blake2b(previous + chunk, digest_size=8).digest()
        fingerprints.append(previous.hex())
    return fingerprints
