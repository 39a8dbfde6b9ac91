"""Adapters this engine downloaded, kept on its local disk under a byte bound: one folder per content digest,
evicted least-recently-used first.

Bytes are reserved before they are written (a download reserves the length its answer announces), so the files
under `root`, complete and partial together, never exceed `max_bytes`. A download stages its files in a hidden
folder beside the entries and moves it into place whole; a crash leaves only staging folders, removed at start.
Every method runs on the server's event loop thread: no locks.
"""

import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

STAGING_PREFIX = ".staging-"


class CacheFull(Exception):
    """The bytes asked for do not fit under the bound, even with every entry evicted."""


class AdapterDiskCache:
    def __init__(self, root: Path, *, max_bytes: int, complete_marker: str,
                 on_evict: Callable[[str], None] = lambda digest: None) -> None:
        if max_bytes <= 0:
            raise ValueError("the adapter disk cache's bound must be > 0 bytes")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.on_evict = on_evict
        self._entries: OrderedDict[str, int] = OrderedDict()  # digest -> bytes, least recently used first
        self._entry_bytes = 0  # the sum of _entries' values
        self._reserved = 0
        self.root.mkdir(parents=True, exist_ok=True)
        found = []
        for path in self.root.iterdir():
            if path.is_dir() and not path.name.startswith(STAGING_PREFIX) and (path / complete_marker).is_file():
                found.append((path.stat().st_mtime, path.name, folder_bytes(path)))
            else:
                _remove(path)
        for _, digest, size in sorted(found):
            self._entries[digest] = size
            self._entry_bytes += size
        self._evict_until(self.max_bytes)

    @property
    def used_bytes(self) -> int:
        """Bytes of complete entries and of downloads in flight (reserved)."""
        return self._entry_bytes + self._reserved

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    def get(self, digest: str) -> Path | None:
        """The entry's folder, marked as just used; None when it is not here."""
        if digest not in self._entries:
            return None
        self._entries.move_to_end(digest)
        return self.root / digest

    def reserve(self, num_bytes: int) -> None:
        """Room for num_bytes more, evicting least-recently-used entries; CacheFull when it cannot be had."""
        if num_bytes > self.max_bytes - self._reserved:
            raise CacheFull(f"{num_bytes} bytes do not fit in the adapter disk cache's {self.max_bytes}"
                            f" ({self._reserved} reserved by downloads in flight)")
        self._evict_until(self.max_bytes - self._reserved - num_bytes)
        self._reserved += num_bytes

    def release(self, num_bytes: int) -> None:
        self._reserved -= num_bytes
        assert self._reserved >= 0, self._reserved

    def staging(self) -> Path:
        """A fresh folder to download into (on the cache's file system, so `commit` is a rename)."""
        return Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.root))

    def commit(self, digest: str, staged: Path, *, reserved: int) -> Path:
        """Move a staged download into place as `digest`'s entry; its reservation becomes the entry's size."""
        target = self.root / digest
        self.discard(digest)
        staged.rename(target)
        self._reserved -= reserved
        self._entries[digest] = reserved
        self._entry_bytes += reserved
        return target

    def discard(self, digest: str) -> None:
        """Remove an entry (a corrupt one: the next request downloads it again)."""
        size = self._entries.pop(digest, None)
        if size is not None:
            self._entry_bytes -= size
            _remove(self.root / digest)
            self.on_evict(digest)

    def _evict_until(self, entry_bytes: int) -> None:
        while self._entries and self._entry_bytes > entry_bytes:
            self.discard(next(iter(self._entries)))


def folder_bytes(path: Path) -> int:
    return sum(entry.stat().st_size for entry in path.iterdir() if entry.is_file())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
