"""Full KV blocks out of one page pool and into another, and as bytes on a wire.

A KVBlock is one block's key and its K and V of every layer, as the pool holds them: the bytes of the KV
cache dtype (fp8 pages stay fp8, with their float32 scale per token and KV head) and the layout that says
how to read them. `export_blocks` copies cached blocks out of the pool by key; `import_blocks` writes
blocks into free pages and names them as cached prefix blocks, each only if its key is the one the
importing engine computed itself for that place in the prompt's chain: a block under any other key is
refused (the prompt recomputes it), never served.

`encode`/`decode` frame blocks as bytes for a transport: magic, a JSON header (layout, keys, sizes, a
blake2b checksum of the body), then the raw KV bytes and scales. No pickle. A transport that moves pages without
framing them (NIXL, engine/kv/nixl.py) checks each block by `block_sums` instead, computed where the bytes are (on
the GPU for a CUDA pool): a weighted sum of the block's 32-bit words, modulo 2^64.
"""

import functools
import hashlib
import json
import logging
from dataclasses import asdict, dataclass

import torch

from engine.block_manager import BlockManager
from engine.kv.connector import ConnectorScheduler
from engine.paged_memory import PagedMemory

log = logging.getLogger(__name__)

MAGIC = b"QKVB"
VERSION = 1


class PayloadError(ValueError):
    """Bytes that are not a whole, intact block payload."""


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    kv_dtype: str  # torch dtype name: "float32", "bfloat16", "float8_e4m3fn", ...
    scales: bool  # an fp8 cache: a float32 scale per token and KV head

    @classmethod
    def of(cls, memory: PagedMemory) -> "KVLayout":
        _, block_size, kv_heads, head_dim = memory.kv_shape
        return cls(num_layers=len(memory.layers), block_size=block_size, kv_heads=kv_heads, head_dim=head_dim,
                   kv_dtype=str(memory.kv_dtype).removeprefix("torch."), scales=memory.scales is not None)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.kv_dtype)

    @property
    def half_bytes(self) -> int:
        """Bytes of one layer's K (or V) of one block."""
        return self.block_size * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def scale_values(self) -> int:
        return self.block_size * self.kv_heads if self.scales else 0


@dataclass(frozen=True)
class KVBlock:
    key: bytes
    layout: KVLayout
    kv: torch.Tensor  # [num_layers, 2 (K, V), half_bytes] uint8, on the CPU
    scales: torch.Tensor | None  # [num_layers, 2, block_size * kv_heads] float32 (fp8 cache), else None

    def k(self, layer: int) -> torch.Tensor:
        """Layer's K, [block_size, kv_heads, head_dim] in the KV dtype."""
        return self._half(layer, 0)

    def v(self, layer: int) -> torch.Tensor:
        return self._half(layer, 1)

    def _half(self, layer: int, half: int) -> torch.Tensor:
        lay = self.layout
        return self.kv[layer, half].view(lay.dtype).view(lay.block_size, lay.kv_heads, lay.head_dim)


# the pool's pages, as bytes
def _bytes(memory: PagedMemory, layer: int) -> torch.Tensor:
    return memory.layers[layer].view(torch.uint8)  # [2, pages + 1, half_bytes]


def read_pages(memory: PagedMemory, block_ids: list[int], *, pin: bool = False, non_blocking: bool = False):
    """The pages' KV bytes [n, layers, 2, half_bytes] uint8 and scales [n, layers, 2, S] float32 (or None), on the
    CPU (pinned with pin: then, non_blocking, the copy is queued on the current stream and must be waited for)."""
    index = _index(block_ids, memory.layers[0].device)
    kv = torch.stack([_bytes(memory, layer).index_select(1, index) for layer in range(len(memory.layers))])
    kv = _to_host(kv.permute(2, 0, 1, 3), pin, non_blocking)  # [n, L, 2, B]
    scales = None
    if memory.scales is not None:
        scales = torch.stack([s.index_select(1, index) for s in memory.scales])
        scales = _to_host(scales.permute(2, 0, 1, 3), pin, non_blocking)  # [n, L, 2, S]
    return kv, scales


def _index(block_ids: list[int], device: torch.device) -> torch.Tensor:
    index = torch.tensor(block_ids, dtype=torch.int64)
    if device.type == "cuda":  # from pinned memory: a pageable copy would wait for the stream's earlier work
        index = index.pin_memory().to(device, non_blocking=True)
    return index


def _to_host(t: torch.Tensor, pin: bool, non_blocking: bool) -> torch.Tensor:
    if t.device.type == "cpu":
        return t.contiguous()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    out.copy_(t, non_blocking=non_blocking and pin)
    return out


def write_pages(memory: PagedMemory, block_ids: list[int], kv: torch.Tensor, scales: torch.Tensor | None, *,
                non_blocking: bool = False) -> None:
    """Write KV bytes [n, layers, 2, half_bytes] (and scales [n, layers, 2, S]) into the pages block_ids."""
    device = memory.layers[0].device
    index = _index(block_ids, device)
    kv = kv.to(device, non_blocking=non_blocking)
    for layer in range(len(memory.layers)):
        _bytes(memory, layer).index_copy_(1, index, kv[:, layer].transpose(0, 1))
    if memory.scales is not None:
        scales = scales.to(device, non_blocking=non_blocking)
        for layer, s in enumerate(memory.scales):
            s.index_copy_(1, index, scales[:, layer].transpose(0, 1))


# sums of blocks where they lie
SUM_SEED = 0x5157_4B56  # every engine draws the same weights


@functools.lru_cache(maxsize=16)
def _weights(count: int, device: torch.device) -> torch.Tensor:
    """`count` odd int64 weights below 2^31, the same on every engine and device (made once per size and device:
    every pull sums its blocks with them)."""
    generator = torch.Generator().manual_seed(SUM_SEED)
    return (torch.randint(0, 1 << 30, (count,), generator=generator, dtype=torch.int64) * 2 + 1).to(device)


def _words(t: torch.Tensor) -> torch.Tensor:
    """[..., bytes] as [..., words] int64 (the bytes read as little-endian int32)."""
    return t.contiguous().view(torch.int32).to(torch.int64)


def block_sums(kv: torch.Tensor, scales: torch.Tensor | None) -> list[int]:
    """One sum per block of kv [n, layers, 2, half_bytes] uint8 (and scales [n, layers, 2, S] float32): each
    32-bit word times a weight that depends on its place (word, layer, K or V, KV or scale), added modulo 2^64.
    Any change of one word changes the sum; so does a chunk moved to another place. Not a defence against an
    attacker: against bytes that went astray (a transfer cut short, a late write, a page mixed up)."""
    n, layers = kv.shape[0], kv.shape[1]
    total = torch.zeros(n, dtype=torch.int64, device=kv.device)
    parts = [(kv, 0)] + ([(scales.view(torch.uint8), 2 * layers)] if scales is not None else [])
    for part, offset in parts:
        words = part.shape[-1] // 4
        weights = _weights(words, part.device)
        for layer in range(layers):
            for half in (0, 1):
                place = 2 * (offset + 2 * layer + half) + 1
                total += (_words(part[:, layer, half]) * weights).sum(-1) * place
    return total.tolist()


def page_sums(memory: PagedMemory, block_ids: list[int]) -> list[int]:
    """block_sums of pages in the pool, computed on the pool's device."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=memory.layers[0].device)
    kv = torch.stack([_bytes(memory, layer).index_select(1, index) for layer in range(len(memory.layers))])
    scales = None
    if memory.scales is not None:
        scales = torch.stack([s.index_select(1, index) for s in memory.scales]).permute(2, 0, 1, 3)
    return block_sums(kv.permute(2, 0, 1, 3), scales)


# blocks by key
def export_blocks(block_manager: BlockManager, memory: PagedMemory, keys: list[bytes]) -> list[KVBlock]:
    """Copies of the cached blocks of the leading run of keys (up to the first one not in the pool), in host
    memory (pinned on CUDA: the staging a transport sends from)."""
    block_ids = block_manager.hold(keys)
    try:
        pin = memory.layers[0].device.type == "cuda"
        kv, scales = read_pages(memory, block_ids, pin=pin) if block_ids else (None, None)
    finally:
        block_manager.release(block_ids)
    layout = KVLayout.of(memory)
    return [KVBlock(key=key, layout=layout, kv=kv[i], scales=None if scales is None else scales[i])
            for i, key in enumerate(keys[: len(block_ids)])]


def held_run(block_manager: BlockManager, tier: ConnectorScheduler | None, keys: list[bytes]) -> int:
    """How many of keys, from the first, this engine holds: in its pool, or in the tier behind it (its host tier,
    from which the scheduler loads them at admission)."""
    count = 0
    while count < len(keys):
        if keys[count] in block_manager.cached:
            count += 1
        elif tier is not None and (behind := tier.lookup(keys[count:])):
            count += behind
        else:
            break
    return count


def import_blocks(block_manager: BlockManager, memory: PagedMemory, blocks: list[KVBlock], keys: list[bytes],
                  *, tier: ConnectorScheduler | None = None) -> int:
    """Install blocks as cached prefix blocks; returns how many were installed. `keys`: the chain the importing
    engine computed itself for the prompt. Blocks this engine holds already (in the pool, or in `tier`: see
    held_run) are skipped; the others must continue that run in chain order, each under exactly its place's
    key: from the first that does not, the rest are refused. As many as there are free pages are installed."""
    layout = KVLayout.of(memory)
    if any(block.layout != layout for block in blocks):
        log.warning("kv import refused: block layout %s differs from this pool's %s", blocks[0].layout, layout)
        return 0
    present = block_manager.hold(keys)  # the cached run stays while the rest is written after it
    try:
        start = held_run(block_manager, tier, keys)
        here = set(keys[:start])
        todo = [block for block in blocks if block.key not in here]
        matched = 0
        while matched < len(todo) and start + matched < len(keys) and todo[matched].key == keys[start + matched]:
            matched += 1
        if matched < len(todo):
            log.warning("kv import refused %d of %d blocks: key %s is not this engine's key at block %d",
                        len(todo) - matched, len(blocks), todo[matched].key.hex(), start + matched)
        todo = todo[: min(matched, block_manager.num_free_blocks)]
        if not todo:
            return 0
        block_ids = block_manager.take_blocks(len(todo))
        kv = torch.stack([block.kv for block in todo])  # [n, L, 2, B]
        scales = torch.stack([block.scales for block in todo]) if layout.scales else None
        write_pages(memory, block_ids, kv, scales)
        block_manager.install(block_ids, [block.key for block in todo])
        return len(todo)
    finally:
        block_manager.release(present)


# bytes
def encode(blocks: list[KVBlock]) -> bytes:
    """Blocks (all of one layout) as bytes: MAGIC, header length (4 bytes, little-endian), JSON header, body."""
    if not blocks:
        layout = None
        body = b""
    else:
        layout = blocks[0].layout
        if any(block.layout != layout for block in blocks):
            raise ValueError("blocks of different layouts in one payload")
        parts = [torch.stack([block.kv for block in blocks]).numpy().tobytes()]
        if layout.scales:
            parts.append(torch.stack([block.scales for block in blocks]).numpy().tobytes())
        body = b"".join(parts)
    header = json.dumps({
        "version": VERSION,
        "layout": asdict(layout) if layout else None,
        "keys": [block.key.hex() for block in blocks],
        "checksum": hashlib.blake2b(body, digest_size=16).hexdigest(),
    }).encode()
    return MAGIC + len(header).to_bytes(4, "little") + header + body


def decode(data: bytes | memoryview) -> list[KVBlock]:
    """The blocks `encode` framed; PayloadError if the bytes are not exactly that, intact."""
    data = memoryview(data)
    if bytes(data[:4]) != MAGIC or len(data) < 8:
        raise PayloadError("not a KV block payload")
    size = int.from_bytes(data[4:8], "little")
    try:
        header = json.loads(bytes(data[8 : 8 + size]))
        if header["version"] != VERSION:
            raise PayloadError(f"payload version {header['version']}, this engine reads {VERSION}")
        layout = KVLayout(**header["layout"]) if header["layout"] else None
        keys = [bytes.fromhex(key) for key in header["keys"]]
        checksum = header["checksum"]
    except (ValueError, KeyError, TypeError) as error:
        raise PayloadError(f"unreadable payload header: {error}") from error
    body = data[8 + size :]
    if hashlib.blake2b(body, digest_size=16).hexdigest() != checksum:
        raise PayloadError("payload checksum mismatch (truncated or corrupted)")
    if layout is None:
        return []
    n, kv_size = len(keys), len(keys) * layout.num_layers * 2 * layout.half_bytes
    scale_size = n * layout.num_layers * 2 * layout.scale_values * 4
    if len(body) != kv_size + scale_size:
        raise PayloadError(f"payload body of {len(body)} bytes, its header says {kv_size + scale_size}")
    kv = torch.frombuffer(bytearray(body[:kv_size]), dtype=torch.uint8).view(n, layout.num_layers, 2, layout.half_bytes)
    scales = None
    if layout.scales:
        scales = torch.frombuffer(bytearray(body[kv_size:]), dtype=torch.float32).view(
            n, layout.num_layers, 2, layout.scale_values)
    return [KVBlock(key=key, layout=layout, kv=kv[i], scales=None if scales is None else scales[i])
            for i, key in enumerate(keys)]
