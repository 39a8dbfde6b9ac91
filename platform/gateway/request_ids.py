"""Request ids: `uuid.uuid4().hex`, from os.urandom's bytes read 4 KiB at a time."""

import os
import threading


class _RandomBytes(threading.local):
    """os.urandom's bytes, 16 at a time from reads of 4 KiB: one getrandom system call per 256 request ids, not one
    each; per thread, and a forked child starts afresh (it must not repeat its parent's)."""

    pool = b""
    at = 0

    def take(self, size: int) -> bytes:
        at = self.at
        if at + size > len(self.pool):
            self.pool, at = os.urandom(4096), 0
        self.at = at + size
        return self.pool[at : at + size]


_random_bytes = _RandomBytes()
os.register_at_fork(after_in_child=_random_bytes.__dict__.clear)


def request_id_hex(random16: bytes | None = None) -> str:
    """`uuid.uuid4().hex` (the same version and variant bits over 16 random bytes), without building a UUID."""
    number = int.from_bytes(_random_bytes.take(16) if random16 is None else random16, "big")
    return "%032x" % (number & _UUID4_CLEAR | _UUID4_SET)


_UUID4_CLEAR = ~((0xC000 << 48) | (0xF000 << 64)) & ((1 << 128) - 1)
_UUID4_SET = (0x8000 << 48) | (4 << 76)
