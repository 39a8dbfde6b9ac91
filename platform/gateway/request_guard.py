"""Hostile input to the inference API stops here, as a 4xx in OpenAI's shape: bodies past a size, JSON nested past
a depth, text that is not Unicode (lone surrogates: they can't be encoded to send on), and NUL characters in names
(the model, `user`, message names), which no database or engine name may hold."""

import re

from django.conf import settings

from gateway.errors import ApiError, invalid
from gateway.hot_settings import hot

MAX_DEPTH = 32
MAX_MODEL_NAME = 256
_SURROGATE = re.compile("[\ud800-\udfff]")
_NAME_FIELDS = ("model", "user", "name")


FILE_UPLOAD_PATH = "/v1/files"
MULTIPART_SLACK = 64 * 1024  # the multipart envelope around an uploaded file: boundaries, headers, `purpose`


def body_limit(*, method: str, path: str) -> int:
    """The most bytes a request may send: a fine-tuning file upload may be as large as a file may be."""
    if method == "POST" and path.rstrip("/") == FILE_UPLOAD_PATH:
        return max(settings.QUILT_MAX_REQUEST_BYTES, settings.QUILT_FINE_TUNING_MAX_FILE_BYTES + MULTIPART_SLACK)
    return hot.QUILT_MAX_REQUEST_BYTES


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is larger than {limit} bytes.", code="request_too_large")


def json_content_type_check(content_type: str) -> None:
    """A body declared as anything but JSON (a form, text) is refused; one sent with no type is read as JSON."""
    if content_type and not content_type.endswith(("/json", "+json")):
        raise ApiError(415, f"Unsupported Content-Type '{content_type}': send the request body as JSON, with "
                            "'Content-Type: application/json'.", code="unsupported_media_type")  # fmt: skip


def model_name_check(name) -> None:
    if not isinstance(name, str):
        return
    if len(name) > MAX_MODEL_NAME:
        raise invalid(f"The model name is longer than {MAX_MODEL_NAME} characters.", param="model")
    if "\x00" in name or not name.isascii() and _SURROGATE.search(name):  # isascii: a flag, no scan
        raise invalid("The model name holds characters no model name has.", param="model")


def raw_body_check(raw: bytes, body) -> None:
    """`body_check(body)` for `body` parsed from `raw`, skipping the walk when the raw bytes cannot hold what it
    looks for: a lone surrogate or a NUL reaches a parsed string only through a `\\u` escape, a UTF-8 surrogate (its
    lead byte 0xED; `json` decodes with surrogatepass) or a UTF-16/32 body (NUL bytes); nesting past MAX_DEPTH needs
    MAX_DEPTH brackets. The common well-formed body has none of them: its model name alone is checked."""
    if b"\\u" in raw or b"\xed" in raw or b"\x00" in raw or raw.count(b"[") + raw.count(b"{") >= MAX_DEPTH:
        body_check(body)
    else:
        model_name_check(body.get("model"))


def body_check(body) -> None:
    """Walks the parsed body once, without recursion."""
    pending = [(body, 1, None)]
    while pending:
        value, depth, key = pending.pop()
        if depth > MAX_DEPTH:
            raise invalid(f"The request body is nested more than {MAX_DEPTH} levels deep.")
        if isinstance(value, dict):
            pending.extend((item, depth + 1, name) for name, item in value.items())
            for name in value:
                _text_check(name, None)
        elif isinstance(value, list):
            pending.extend((item, depth + 1, key) for item in value)
        elif isinstance(value, str):
            _text_check(value, key)
    model_name_check(body.get("model") if isinstance(body, dict) else None)


def _text_check(text: str, key: str | None) -> None:
    if _SURROGATE.search(text):
        raise invalid("The request body holds a lone UTF-16 surrogate, which is not valid Unicode text.", param=key)
    if key in _NAME_FIELDS and "\x00" in text:
        raise invalid(f"'{key}' must not contain NUL characters.", param=key)
