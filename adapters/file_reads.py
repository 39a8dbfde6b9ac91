"""How an adapter's weights file is read from disk: paced, and around the page cache, when configured."""

import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ReadPolicy:
    bytes_per_second: int = 0  # a cap on the read rate (a disk or network volume shared with other engines); 0: none
    uncached: bool = False  # posix_fadvise(DONTNEED) before and after the read: the bytes come from the device, and
    # no second copy stays in the page cache (the engine's host tier is the adapter cache)

    def __post_init__(self) -> None:
        if self.bytes_per_second < 0:
            raise ValueError("bytes_per_second must be >= 0")


DEFAULT = ReadPolicy()


class Pacer:
    """Sleeps after each block read so that the file's bytes arrive no faster than the policy's rate."""

    def __init__(self, policy: ReadPolicy) -> None:
        self.rate = policy.bytes_per_second
        self.started = time.monotonic()

    def read(self, total: int) -> None:
        """`total` bytes were read so far."""
        if self.rate:
            ahead = self.started + total / self.rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)


def drop_cached(fileno: int, policy: ReadPolicy) -> None:
    """Ask the kernel to drop the file's pages from the page cache (clean pages go; dirty ones stay until written)."""
    if policy.uncached:
        os.posix_fadvise(fileno, 0, 0, os.POSIX_FADV_DONTNEED)
