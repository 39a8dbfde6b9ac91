"""The hot path's own stand-ins give what the library code they stand in for gives: the Content-Type's media type as Django parses it."""

import pytest
from django.utils.http import parse_header_parameters

from gateway.asgi import _media_type


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
