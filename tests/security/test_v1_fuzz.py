"""Hostile bodies and names against the inference API (/v1) on a real uvicorn gateway: each is a 4xx in OpenAI's
error shape (never a 5xx, never HTML), and the gateway keeps serving."""

import json

import httpx
import pytest

from registry.models import BaseModel
from tests.platform.factories import TenantFactory, make_key
from tests.security.gateways import gateways

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
MESSAGES = [{"role": "user", "content": "hi"}]


def _cases(key: str) -> list[tuple[str, str, str, bytes, int]]:
    """(name, method, path, body, expected status)"""

    def chat(**fields) -> bytes:
        return json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": 1, **fields}).encode()

    nested = b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return [
        ("3 MB body", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "a" * 3_000_000}]), 413),
        ("lone surrogate in the model", "POST", "/v1/chat/completions", chat().replace(b'"tiny"', b'"\\ud800"'), 400),
        ("lone surrogate in content", "POST", "/v1/chat/completions", chat().replace(b'"hi"', b'"h\\udfffi"'), 400),
        ("lone surrogate in a stop", "POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "x", "stop": ["a"]}).encode().replace(b'"a"', b'"\\udc00"'), 400),  # noqa: E501
        ("invalid UTF-8", "POST", "/v1/chat/completions", chat().replace(b'"hi"', b'"h\xff\xfei"'), 400),
        ("deeply nested JSON", "POST", "/v1/chat/completions", nested, 400),
        ("nested 200 deep", "POST", "/v1/chat/completions", chat(metadata=json.loads("[" * 200 + "]" * 200)), 400),
        ("NUL in the model", "POST", "/v1/chat/completions", chat(model="ti\u0000ny"), 400),
        ("NUL in a message name", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "x", "name": "a\u0000"}]), 400),  # noqa: E501
        ("NUL in user", "POST", "/v1/chat/completions", chat(user="u\u0000"), 400),
        ("NUL in the model path", "GET", "/v1/models/ti%00ny", b"", 400),
        ("surrogate in the model path", "GET", "/v1/models/%ED%A0%80", b"", 404),  # uvicorn decodes it to U+FFFD
        ("a huge model name", "POST", "/v1/chat/completions", chat(model="m" * 100_000), 400),
        ("OPTIONS", "OPTIONS", "/v1/chat/completions", b"", 405),
        ("not JSON", "POST", "/v1/completions", b"\x00\x01\x02", 400),
    ]


def test_hostile_requests_get_openai_shaped_4xx(tmp_path):
    BaseModel.objects.create(name="tiny", checkpoint_dir="/nowhere", architecture="llama", config={}, max_context=64)
    _, key = make_key(TenantFactory(slug="sec-fuzz"), scopes=["inference"])
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    wrong = []
    with gateways(tmp_path, 1) as (urls, _):
        with httpx.Client(base_url=urls[0], timeout=30) as client:
            for name, method, path, body, expected in _cases(key):
                response = client.request(method, path, content=body, headers=headers)
                try:
                    error = response.json()["error"]
                    shaped = {"message", "type", "param", "code"} <= set(error)
                except (ValueError, KeyError, TypeError):
                    shaped = False
                if response.status_code != expected or not shaped:
                    wrong.append((name, response.status_code, response.text[:200]))
            assert client.get("/v1/models/tiny", headers=headers).status_code == 200  # still serving
    assert wrong == [], "\n".join(map(str, wrong))
