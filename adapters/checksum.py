"""Fast checksums of a stored adapter, kept in its sidecar and checked on every read.

The content digest (sha256 over the tensors and scalings) names an adapter; it is computed once, when the adapter
is first made known. What changes a stored folder afterwards (a failing disk, a torn copy, a flipped bit) is
caught by an xxh3 checksum of the weights file, computed over each block as it is read (memory speed: see
benchmarks/adapter_checksum.py), and one of the sidecar's own fields. It guards against accidents, not against
someone who can write the store: they could rewrite the sidecar too.
"""

import json
from typing import Any

import xxhash

ALGORITHM = "xxh3_64"


def new_hasher() -> "xxhash.xxh3_64":
    """A running checksum: `update(bytes)` block by block, then `hexdigest()`."""
    return xxhash.xxh3_64()


def of_bytes(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def of_fields(fields: dict[str, Any]) -> str:
    """The checksum of a sidecar's fields, as JSON with sorted keys (what json.loads gives back compares equal)."""
    return of_bytes(json.dumps(fields, sort_keys=True).encode())
