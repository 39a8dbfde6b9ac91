"""The files a KV source keeps in /dev/shm (tmpfs: shared memory, one host): its marker, `quilt-kv-<pid>-<hex>`,
locked (flock) for as long as the source runs, and the segments it offers, `<marker>.<hex>`, each the payloads of
one pull. A source killed with SIGKILL cleans nothing up; the next source to start on the host reaps the files whose
marker nobody holds (`reap_dead_sources`). engine/kv/transport.py's `ShmTransport` offers and accepts segments."""

import fcntl
import mmap
import os
from pathlib import Path

SHM_ROOT = Path("/dev/shm")


def map_segment(path: Path) -> mmap.mmap | bytes:
    """The segment's bytes, mapped read-only (no copy), and its name unlinked: the mapping outlives the name, and a
    source that dies after offering it leaves nothing behind in /dev/shm."""
    with path.open("rb") as segment:
        size = os.fstat(segment.fileno()).st_size
        mapped = mmap.mmap(segment.fileno(), size, access=mmap.ACCESS_READ) if size else b""
    path.unlink(missing_ok=True)
    return mapped


def write_segment(path: Path, payloads: list[bytes]) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "wb") as segment:
        for payload in payloads:
            segment.write(payload)


# files in /dev/shm: a source's marker, quilt-kv-<pid>-<hex>, and the segments it offers, <marker>.<hex>
SHM_PREFIX = "quilt-kv-"


def claim_marker(name: str) -> int:
    """Create the marker `name` under an exclusive lock held until the descriptor returned is closed (the process
    ending closes it, SIGKILL included): the lock is how a successor tells a dead source's files from a live one's.
    The file appears under its name already locked (written aside, then renamed)."""
    aside = SHM_ROOT / f".{name}.claiming"
    fd = os.open(aside, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(aside, SHM_ROOT / name)
    except OSError:
        os.close(fd)
        aside.unlink(missing_ok=True)
        raise
    return fd


def _source_alive(path: Path) -> bool:
    """Whether the source that made this marker (or half-claimed one) still runs: its lock is held, or, for a source
    from before markers were locked, its pid (in the name) is a live process here. In doubt, alive: a leftover is
    cheaper than a live source's segment removed under a puller."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # (a lock taken here goes with it)
    pid = path.name.removeprefix(".").removeprefix(SHM_PREFIX).split("-", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def reap_dead_sources() -> list[str]:
    """Remove what dead sources left in /dev/shm (a SIGKILL runs no cleanup): their markers, the segments they
    offered that no puller mapped (a segment whose marker is gone is an orphan), and half-claimed markers. Returns
    the names removed."""
    removed = []
    for path in sorted(SHM_ROOT.glob(f"{SHM_PREFIX}*")) + sorted(SHM_ROOT.glob(f".{SHM_PREFIX}*")):
        owner = path if path.name.startswith(".") else SHM_ROOT / path.name.split(".", 1)[0]
        if not _source_alive(owner):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def shm_reachable(address: dict) -> bool:
    """Whether the source's shared memory is ours too (same host, same /dev/shm): its marker is there."""
    name = address.get("shm")
    return isinstance(name, str) and name.startswith("quilt-kv-") and "/" not in name and (SHM_ROOT / name).exists()
