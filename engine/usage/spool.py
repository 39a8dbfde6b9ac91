"""The usage write-ahead log: every finished request's event is written here before `emit` returns, and stays
pending until the broker has taken it.

Two append-only JSON-lines files: the log (`path`: one event per line) and its acknowledgements (`path.acked`:
one request id per line, written after the broker took the event). Pending = logged and not acknowledged. A
`write()` reaches the kernel before `record` returns, so a killed process (`kill -9`) loses nothing; the log is
fsynced in groups (`sync`, each delivery round) against a machine crash. When nothing is pending the two files
are truncated; a log past COMPACT_BYTES with events still pending (a busy engine never drains to zero) is
rewritten with only those, atomically (written aside, fsynced, renamed over the log). A crash at any point leaves every unacknowledged event on disk: at worst one is sent twice, which
the request id (the idempotency key) absorbs downstream. A torn last line (a crash mid-write) is skipped.
"""

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

COMPACT_BYTES = 8 * 1024 * 1024


class UsageSpool:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.acked_path = self.path.with_name(self.path.name + ".acked")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._unsynced = False
        self._log_bytes = self.path.stat().st_size if self.path.exists() else 0
        self._pending: dict[str, dict[str, Any]] = {}
        for path in (self.path, self.acked_path):
            _end_torn_line(path)
        for segment in [*self._old_segments(), self.path]:
            for event in read_events(segment):
                self._pending.setdefault(str(event.get("request_id")), event)
        for request_id in _read_ids(self.acked_path):
            self._pending.pop(request_id, None)

    def record(self, event: dict[str, Any]) -> None:
        """Writes one event to the log (no fsync: see `sync`); it is pending from now on."""
        line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
        with self._lock:
            _append(self.path, line)
            self._log_bytes += len(line)
            self._pending[str(event["request_id"])] = event
            self._unsynced = True

    def append(self, events: list[dict[str, Any]]) -> None:
        """Logs several events durably (written and fsynced before this returns)."""
        for event in events:
            self.record(event)
        self.sync()

    def sync(self) -> None:
        """fsyncs the log if anything was written since the last call (group commit)."""
        with self._lock:
            if not self._unsynced or not self.path.exists():
                return
            self._unsynced = False
            fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def acknowledge(self, request_ids: list[str]) -> None:
        """The broker took these events. When nothing is left pending, both files are truncated."""
        with self._lock:
            _append(self.acked_path, "".join(f"{request_id}\n" for request_id in request_ids).encode())
            for request_id in request_ids:
                self._pending.pop(request_id, None)
            if not self._pending:
                for old in self._old_segments():
                    old.unlink()
                for path in (self.path, self.acked_path):  # the log first: a crash between leaves only acks
                    if path.exists():
                        os.truncate(path, 0)
                self._unsynced = False
                self._log_bytes = 0
            elif self._log_bytes > COMPACT_BYTES:
                self._compact()

    def _compact(self) -> None:
        """Lock held: the log rewritten with the pending events only; then the acknowledgements dropped."""
        aside = self.path.with_name(self.path.name + ".compacting")
        data = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in self._pending.values()).encode()
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(aside, self.path)
        _fsync_dir(self.path.parent)
        for old in self._old_segments():
            old.unlink()
        os.truncate(self.acked_path, 0)  # after the rename: a crash between leaves acks of events no longer logged
        self._log_bytes = len(data)
        self._unsynced = False

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def pending(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._pending.values())

    def has_pending(self) -> bool:
        return bool(self._pending)

    def pending_count(self) -> int:
        return len(self._pending)

    def _old_segments(self) -> list[Path]:
        """`path.draining-N` files an earlier version of the spool left behind: read as part of the log."""
        prefix = self.path.name + ".draining-"
        return sorted(p for p in self.path.parent.glob(prefix + "*") if p.name[len(prefix):].isdigit())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _end_torn_line(path: Path) -> None:
    """A crash mid-write can leave a last line without its newline: end it, so the next line stands alone."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        torn = f.read(1) != b"\n"
    if torn:
        _append(path, b"\n")


def _append(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _read_ids(path: Path) -> list[str]:
    if not path.exists():
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        return [line.strip() for line in f if line.endswith("\n") and line.strip()]


def read_events(path: Path) -> list[dict[str, Any]]:
    """Events in a log file; a torn last line (a crash mid-write) is skipped with a warning."""
    if not path.exists():
        return []
    events = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                log.warning("skipping unreadable line %d of usage spool %s", number, path)
                continue
            if isinstance(event, dict) and event.get("request_id"):
                events.append(event)
    return events
