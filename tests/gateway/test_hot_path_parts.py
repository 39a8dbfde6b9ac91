"""The hot path's own stand-ins give what the library code they stand in for gives: the request id as uuid4's hex,
the Content-Type's media type as Django parses it."""

import os
import uuid

import pytest
from django.utils.http import parse_header_parameters

from gateway.asgi import _media_type
from gateway.request_ids import request_id_hex


def test_request_ids_take_their_random_bytes_256_at_a_time(monkeypatch):
    """One getrandom system call per 256 ids (os.urandom's bytes, read 4 KiB at a time); a forked child's next id
    is not its parent's."""
    from gateway import request_ids

    reads = []
    real = os.urandom
    monkeypatch.setattr(request_ids.os, "urandom", lambda size: reads.append(size) or real(size))
    request_ids._random_bytes.__dict__.clear()
    ids = [request_id_hex() for _ in range(512)]
    assert reads == [4096, 4096] and len(set(ids)) == 512
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: its next id, to the parent
        os.write(write, request_id_hex().encode())
        os._exit(0)
    os.waitpid(child, 0)
    assert os.read(read, 64).decode() != request_id_hex()


def test_request_ids_are_uuid4_hex_of_the_same_bytes():
    for random16 in [bytes(16), b"\xff" * 16] + [os.urandom(16) for _ in range(2000)]:
        assert request_id_hex(random16) == uuid.UUID(bytes=random16, version=4).hex
    ids = {request_id_hex() for _ in range(1000)}
    assert len(ids) == 1000 and all(uuid.UUID(hex=value).version == 4 for value in ids)


@pytest.mark.parametrize("header", ["application/json", "Application/JSON; charset=utf-8", "", "text/plain;x=1",
                                    'multipart/form-data; boundary="a b"', "application/json ;charset=latin-1"])  # fmt: skip
def test_media_type_is_djangos(header):
    assert _media_type(header) == parse_header_parameters(header)[0]


@pytest.mark.parametrize("headers", [
    [],
    [(b"host", b"g"), (b"content-type", b"application/json"), (b"authorization", b"Bearer k")],
    [(b"authorization", b"Bearer k"), (b"authorization", b"Bearer j")],  # repeated: joined, as Django's META
    [(b"content-type", b"a/b"), (b"accept", b"x"), (b"accept", b"y")],  # another name repeated
    [(b"host", b"g"), (b"x-caf\xc3\xa9", b"\xe9"), (b"authorization", b"Bearer \xe9")],
])  # fmt: skip
def test_the_generation_headers_are_read_as_each_header_alone(headers):
    from gateway.asgi import _generation_headers, _header

    scope = {"headers": headers}
    assert _generation_headers(scope) == (_header(scope, b"content-type"), _header(scope, b"authorization"))
