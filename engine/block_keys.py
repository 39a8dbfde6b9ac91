"""Keys of full KV blocks: a hash chain over (base model digest, adapter content digest, tenant cache salt,
the block's tokens, the parent block's key).

Two blocks share a key only if the same base weights under the same numerics, the same adapter content
(its sha256, never its name: a promoted or reloaded adapter gets new keys) and the same tenant salt
computed the same tokens, standing for the same images (their content digests), after the same prefix. Every link of the chain carries the namespace
(base, adapter, salt), so each key stands on its own. The prefix cache, the host tier and any transfer
between engines name blocks by these keys; a block whose key is not the one asked for is refused.
No torch.
"""

import hashlib
import json
import os
from array import array
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

KEY_BYTES = 16
_ROOT = bytes(KEY_BYTES)  # the parent of a prompt's first block
_CHUNK = 8 << 20


def model_digest(model_dir: str | Path) -> str:
    """sha256 over the checkpoint's config.json and weight files (names and each file's sha256), read once at
    start; the files are hashed in parallel (hashlib lets go of the GIL), so a sharded checkpoint costs about
    its largest shard's time."""
    model_dir = Path(model_dir)
    files = [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]
    with ThreadPoolExecutor(min(len(files), os.cpu_count() or 1)) as pool:
        digests = list(pool.map(_file_digest, files))
    digest = hashlib.sha256()
    for path, file_digest in zip(files, digests, strict=True):
        digest.update(path.name.encode() + b"\x00" + file_digest)
    return digest.hexdigest()


def _file_digest(path: Path) -> bytes:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.digest()


def base_digest(model_digest: str, *, dtype: str, quantization: str | None, kv_cache_dtype: str,
                tensor_parallel_size: int) -> str:
    """What makes one engine's KV values another's: the checkpoint and the numerics that compute the cache."""
    numerics = {"dtype": dtype, "quantization": quantization, "kv_cache_dtype": kv_cache_dtype,
                "tensor_parallel_size": tensor_parallel_size}
    return hashlib.sha256(f"{model_digest}\x00{json.dumps(numerics, sort_keys=True)}".encode()).hexdigest()


def namespace(base: str, adapter: str | None, salt: str) -> bytes:
    """The (base, adapter content, salt) part of every key of one sequence, digested once."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(f"{base}\x00{adapter or ''}\x00{salt}\x00".encode())
    return h.digest()


def block_key(space: bytes, parent: bytes | None, token_ids: list[int], content: bytes = b"") -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(space)
    h.update(parent or _ROOT)
    h.update(array("q", token_ids).tobytes())
    h.update(content)
    return h.digest()


def chain(space: bytes, token_ids: list[int], block_size: int, *, start: list[bytes] = (),
          marks: tuple[tuple[int, int, str], ...] = ()) -> list[bytes]:
    """Keys of the full blocks of token_ids, continuing the keys `start` already has. marks: (first, end, digest)
    of content that positions first..end-1 stand for beyond their token ids (an image over its placeholder
    tokens); a block hashes the digests of the marks it overlaps, so the blocks before an image are shared by
    prompts with other images there, and the image's blocks and every later one are not."""
    keys = list(start)
    for i in range(len(keys), len(token_ids) // block_size):
        first, end = i * block_size, (i + 1) * block_size
        content = "".join(f"{digest}\x00" for lo, hi, digest in marks if lo < end and hi > first).encode()
        keys.append(block_key(space, keys[-1] if i else None, token_ids[first:end], content))
    return keys
