"""Prompt fingerprints: the gateway routes on them, the engine's heartbeat reports those it served."""

import hashlib
import json

PREFIX_CHUNK_CHARS = 256  # a prompt fingerprint covers each whole chunk of this many characters of the prompt
PREFIX_MAX_CHUNKS = 16  # 4 KiB of prompt: system prompts and few-shot preambles, the prefixes worth routing on


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
