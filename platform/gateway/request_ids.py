"""Request ids: `uuid.uuid4().hex`, from os.urandom's bytes read 4 KiB at a time."""

import os
import threading

_BATCH = 256  # ids per read of os.urandom: 16 bytes each
_END = 32 * _BATCH  # the batch's hex digits


class _RandomBytes(threading.local):
    """The hex of 256 ids at a time, from one read of 4 KiB of os.urandom's bytes (one getrandom system call per 256
    request ids, not one each), their version and variant bits set on all of them by one integer operation (in C):
    an id is then a slice. Per thread, and a forked child starts afresh (it must not repeat its parent's)."""

    text = ""
    at = _END  # used up: the first id reads a batch


_random_bytes = _RandomBytes()
os.register_at_fork(after_in_child=_random_bytes.__dict__.clear)


def request_id_hex(random16: bytes | None = None) -> str:
    """`uuid.uuid4().hex` (the same version and variant bits over 16 random bytes), without building a UUID."""
    if random16 is not None:
        return "%032x" % (int.from_bytes(random16, "big") & _UUID4_CLEAR | _UUID4_SET)
    ids = _random_bytes
    at = ids.at
    if at == _END:
        ids.text, at = _batch(), 0
    ids.at = at + 32
    return ids.text[at : at + 32]


def _batch() -> str:
    """`request_id_hex(random16)` of 256 runs of 16 random bytes, joined: the same bits cleared and set in each."""
    number = int.from_bytes(os.urandom(16 * _BATCH), "big")
    return format(number & _BATCH_CLEAR | _BATCH_SET, _BATCH_FORMAT)


_UUID4_CLEAR = ~((0xC000 << 48) | (0xF000 << 64)) & ((1 << 128) - 1)
_UUID4_SET = (0x8000 << 48) | (4 << 76)
_BATCH_CLEAR = sum(_UUID4_CLEAR << (128 * index) for index in range(_BATCH))
_BATCH_SET = sum(_UUID4_SET << (128 * index) for index in range(_BATCH))
_BATCH_FORMAT = f"0{_END}x"
