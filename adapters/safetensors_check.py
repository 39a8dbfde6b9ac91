"""Validate a safetensors file's header ourselves before the library maps a single byte of it.

safetensors refuses most malformed files too, but its errors read like a Rust panic, and an upload is
hostile: we want a bounded header, offsets that tile the data exactly, allowed dtypes and a message a
tenant can act on, all before any tensor is allocated.
"""

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adapters.checksum import ALGORITHM, new_hasher
from adapters.errors import AdapterError
from adapters.file_reads import DEFAULT, Pacer, ReadPolicy, drop_cached

MAX_HEADER_BYTES = 16 << 20
MAX_TENSORS = 1 << 16
ALLOWED_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
READ_BLOCK_BYTES = 4 << 20  # hashed while still in cache
_ITEM_SIZE = {"F16": 2, "BF16": 2, "F32": 4}


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def check_safetensors(path: Path) -> dict[str, TensorEntry]:
    """Parse and validate the header of `path`; returns its tensors by name. Raises AdapterError."""
    name = path.name
    file_size = os.path.getsize(path)
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise AdapterError(
                "safetensors_truncated", f"{name} is truncated: {file_size} bytes, too short to hold a header"
            )
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > MAX_HEADER_BYTES:
            raise AdapterError(
                "safetensors_header_too_large",
                f"{name} declares a {header_size}-byte header; the limit is {MAX_HEADER_BYTES} bytes",
            )
        if 8 + header_size > file_size:
            raise AdapterError(
                "safetensors_truncated",
                f"{name} is truncated: it declares a {header_size}-byte header but holds only {file_size} bytes",
            )
        raw_header = handle.read(header_size)
    header = _parse_header(name, raw_header)
    header.pop("__metadata__", None)
    if len(header) > MAX_TENSORS:
        raise AdapterError(
            "safetensors_invalid", f"{name} holds {len(header)} tensors; the limit is {MAX_TENSORS}"
        )
    entries = {key: _entry(name, key, value) for key, value in header.items()}
    _check_tiling(name, entries, data_size=file_size - 8 - header_size)
    return entries


def read_tensors(path: Path, *, checksum: str | None = None, policy: ReadPolicy = DEFAULT) -> dict[str, torch.Tensor]:
    """The tensors of a file `check_safetensors` accepts, read once into one buffer this process owns (not
    mapped: a mapped file could change after validation, and an unpacked upload is deleted right after); each
    tensor is a view of that buffer, so its bytes are copied from the file once and never again (a tensor whose
    offset does not suit its dtype's alignment, which no writer we know produces, is the one copied).

    `checksum`: the file's (adapters.checksum) when it was stored. Each block is hashed right after it is read,
    while it is still in cache, and a file whose bytes changed is refused (canonical_corrupt). `policy`: the read's
    pace and whether it goes around the page cache (adapters.file_reads)."""
    entries = check_safetensors(path)
    hasher = None if checksum is None else new_hasher()
    pacer = Pacer(policy)
    with open(path, "rb") as handle:
        drop_cached(handle.fileno(), policy)
        prefix = handle.read(8)
        (header_size,) = struct.unpack("<Q", prefix)
        header = handle.read(header_size)
        data = torch.empty(max((e.end for e in entries.values()), default=0), dtype=torch.uint8)  # [data bytes]
        view, filled = memoryview(data.numpy()), 0
        if hasher is not None:
            hasher.update(prefix)
            hasher.update(header)
        while filled < len(view):
            count = handle.readinto(view[filled : filled + READ_BLOCK_BYTES])
            if not count:
                raise AdapterError("safetensors_truncated", f"{path.name} ended while its tensors were read")
            if hasher is not None:
                hasher.update(view[filled : filled + count])
            filled += count
            pacer.read(filled)
        drop_cached(handle.fileno(), policy)
    if hasher is not None and hasher.hexdigest() != checksum:
        raise AdapterError(
            "canonical_corrupt",
            f"{path.name} changed after it was stored: its {ALGORITHM} checksum is {hasher.hexdigest()}, "
            f"the sidecar's is {checksum}",
        )
    tensors = {}
    for name, entry in entries.items():
        raw = data[entry.begin : entry.end]
        if entry.begin % _ITEM_SIZE[entry.dtype]:
            raw = raw.clone()
        tensors[name] = raw.view(ALLOWED_DTYPES[entry.dtype]).view(entry.shape)
    return tensors


def _parse_header(name: str, raw: bytes) -> dict[str, Any]:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        if len(keys) != len(set(keys)):
            raise AdapterError("safetensors_invalid", f"{name} header names a tensor twice")
        return dict(pairs)

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise AdapterError(
            "safetensors_invalid", f"{name} is not a safetensors file (its header is not JSON)"
        ) from None
    if not isinstance(header, dict):
        raise AdapterError(
            "safetensors_invalid", f"{name} is not a safetensors file (its header is not a JSON object)"
        )
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise AdapterError("safetensors_invalid", f"{name} has a malformed __metadata__ block")
    return header


def _entry(name: str, key: str, value: Any) -> TensorEntry:
    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data_offsets"}:
        raise AdapterError("safetensors_invalid", f"{name}: tensor {key} has a malformed header entry")
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if dtype not in ALLOWED_DTYPES:
        raise AdapterError(
            "dtype_unsupported",
            f"tensor {key} is stored as {dtype}; adapters must be float16, bfloat16 or float32",
        )
    if not isinstance(shape, list) or len(shape) > 8 or not all(_non_negative_int(d) for d in shape):
        raise AdapterError("safetensors_invalid", f"{name}: tensor {key} has a malformed shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_non_negative_int(o) for o in offsets):
        raise AdapterError(
            "safetensors_invalid", f"{name}: tensor {key} has malformed data_offsets {offsets!r}"
        )
    begin, end = offsets
    expected = math.prod(shape) * _ITEM_SIZE[dtype]
    if end < begin or end - begin != expected:
        raise AdapterError(
            "safetensors_invalid",
            f"{name}: tensor {key} claims {end - begin} bytes at offsets [{begin}, {end}] "
            f"but a {dtype} tensor of shape {shape} needs {expected}",
        )
    return TensorEntry(dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def _check_tiling(name: str, entries: dict[str, TensorEntry], *, data_size: int) -> None:
    """The tensors must cover the data section exactly: no overlaps, no gaps, nothing past the end."""
    position = 0
    for key, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            problem = "overlaps another tensor" if entry.begin < position else "leaves a gap before it"
            raise AdapterError(
                "safetensors_invalid", f"{name}: the header lies about offsets (tensor {key} {problem})"
            )
        position = entry.end
    if position > data_size:
        raise AdapterError(
            "safetensors_truncated",
            f"{name} is truncated: its header describes {position} bytes of tensor data but the file holds {data_size}",
        )
    if position < data_size:
        raise AdapterError(
            "safetensors_invalid",
            f"{name} has {data_size - position} bytes after the last tensor that its header does not describe",
        )


def _non_negative_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
