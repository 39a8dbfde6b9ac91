"""An adapter the engine cannot read fails its own requests only: a retriable 503 `adapter_unavailable` with no
paths, streamed or not, while the same engine keeps serving every other tenant (it is not sidelined)."""

import concurrent.futures
import shutil
from pathlib import Path

import httpx
import pytest

from registry.models import AdapterVersion
from tests.gateway.conftest import BASE_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.django_db]


def test_a_missing_adapter_is_a_503_for_its_requests_alone(stack):
    version = AdapterVersion.objects.get(adapter__name="fragile", adapter__tenant_id=stack.ids["rival"])
    blob = Path(stack.env["MEDIA_ROOT"]) / "adapters" / version.digest
    hidden = blob.with_name(blob.name + ".away")
    shutil.move(blob, hidden)  # the adapter's files vanish from the engine's host
    try:
        def fragile(_) -> httpx.Response:
            return httpx.post(f"{stack.gateways[0]}/chat/completions", timeout=60,
                              headers={"Authorization": f"Bearer {stack.keys['rival']}"},
                              json={"model": "fragile", "messages": [{"role": "user", "content": "w1"}],
                                    "max_tokens": 2})  # fmt: skip

        def healthy(_) -> int:
            return httpx.post(f"{stack.gateways[0]}/completions", timeout=60,
                              headers={"Authorization": f"Bearer {stack.keys['main']}"},
                              json={"model": BASE_MODEL, "prompt": "w2 w3", "max_tokens": 2}).status_code  # fmt: skip

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            broken = list(pool.map(fragile, range(6)))
            others = list(pool.map(healthy, range(12)))  # right after: the engine was not sidelined
        for response in broken:
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == "adapter_unavailable" and error["type"] == "server_error"
            assert int(response.headers["Retry-After"]) >= 1
            assert "/" not in error["message"] and str(stack.env["MEDIA_ROOT"]) not in response.text
        assert others == [200] * 12
        # asked as a stream, the refusal is the same one JSON error, before any event
        streamed = httpx.post(f"{stack.gateways[0]}/chat/completions", timeout=60,
                              headers={"Authorization": f"Bearer {stack.keys['rival']}"},
                              json={"model": "fragile", "messages": [{"role": "user", "content": "w1"}],
                                    "max_tokens": 2, "stream": True})  # fmt: skip
        assert (streamed.status_code, streamed.headers["content-type"], streamed.headers["retry-after"]) == (
            503, "application/json", "2")  # fmt: skip
        assert streamed.content == b'{"error": {"message": "The adapter of model \'fragile\' could not be loaded right now; please retry shortly.", "type": "server_error", "param": null, "code": "adapter_unavailable"}}'  # fmt: skip
    finally:
        shutil.move(hidden, blob)


def test_a_stored_adapter_with_flipped_bytes_is_a_503_until_repaired(stack):
    """The blob's last byte changed after it was stored: refused on every read, never served, and read again on the
    next request, so once repaired it serves (runs after the test above: its files must not be in memory yet)."""
    version = AdapterVersion.objects.get(adapter__name="fragile", adapter__tenant_id=stack.ids["rival"])
    weights = Path(stack.env["MEDIA_ROOT"]) / "adapters" / version.digest / "adapter_model.safetensors"
    intact = weights.read_bytes()

    def fragile(_=None) -> httpx.Response:
        return httpx.post(f"{stack.gateways[0]}/chat/completions", timeout=60,
                          headers={"Authorization": f"Bearer {stack.keys['rival']}"},
                          json={"model": "fragile", "messages": [{"role": "user", "content": "w1"}],
                                "max_tokens": 2})  # fmt: skip

    weights.write_bytes(intact[:-1] + bytes([intact[-1] ^ 0xFF]))
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            broken = list(pool.map(fragile, range(3)))
        for response in broken:
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "adapter_unavailable"
        healthy = httpx.post(f"{stack.gateways[0]}/completions", timeout=60,
                             headers={"Authorization": f"Bearer {stack.keys['main']}"},
                             json={"model": BASE_MODEL, "prompt": "w2 w3", "max_tokens": 2})  # fmt: skip
        assert healthy.status_code == 200, healthy.text
    finally:
        weights.write_bytes(intact)
    repaired = fragile()
    assert repaired.status_code == 200, repaired.text
