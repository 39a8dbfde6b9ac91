"""An append-only, fsynced JSON-lines file holding usage events the broker could not take yet.

Draining renames the live file aside first (atomic), sends what it holds, then deletes it, so a
crash at any point leaves every event on disk: at worst one is sent twice, which the request id
(the idempotency key) absorbs downstream.
"""

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class UsageSpool:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, events: list[dict[str, Any]]) -> None:
        """Durably append events: written, flushed and fsynced before this returns."""
        if not events:
            return
        created = not self.path.exists()
        data = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events).encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            self._fsync_dir()

    def has_pending(self) -> bool:
        return bool(self._draining_files()) or (self.path.exists() and self.path.stat().st_size > 0)

    def pending_count(self) -> int:
        return sum(len(read_events(p)) for p in self._draining_files() + [self.path] if p.exists())

    def drain(self, send: Callable[[list[dict[str, Any]]], None], *, batch_size: int) -> int:
        """Send every spooled event in batches through `send`; returns how many were sent.

        Stops at the first batch `send` raises on (the exception propagates) and keeps that file.
        """
        if self.path.exists() and self.path.stat().st_size > 0:
            self.path.rename(self._next_draining_name())
            self._fsync_dir()
        sent = 0
        for path in self._draining_files():
            events = read_events(path)
            for start in range(0, len(events), batch_size):
                send(events[start:start + batch_size])
            sent += len(events)
            path.unlink()
            self._fsync_dir()
        return sent

    def _draining_files(self) -> list[Path]:
        prefix = self.path.name + ".draining-"
        found = [p for p in self.path.parent.glob(prefix + "*") if p.name[len(prefix):].isdigit()]
        return sorted(found, key=lambda p: int(p.name[len(prefix):]))

    def _next_draining_name(self) -> Path:
        existing = self._draining_files()
        number = int(existing[-1].name.rsplit("-", 1)[1]) + 1 if existing else 1
        return self.path.with_name(f"{self.path.name}.draining-{number}")

    def _fsync_dir(self) -> None:
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_events(path: Path) -> list[dict[str, Any]]:
    """Events in a spool file; a torn last line (a crash mid-write) is skipped with a warning."""
    events = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("skipping unreadable line %d of usage spool %s", number, path)
    return events
