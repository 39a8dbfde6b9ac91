"""Requests as a raw HTTP client may send them: the status and OpenAI-shaped error each gets, in OpenAI's order
(the key first, then the body)."""

import json

import httpx
import pytest

from tests.gateway.conftest import BASE_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

CHAT = {"model": BASE_MODEL, "messages": [{"role": "user", "content": "w20 w21"}], "max_tokens": 2}


def post(stack, *, content: bytes, headers: dict[str, str], path: str = "/chat/completions") -> httpx.Response:
    return httpx.post(f"{stack.gateways[0]}{path}", content=content, headers=headers, timeout=60)


def error_of(response: httpx.Response) -> dict:
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("authorization", [None, "Bearer nope.not-a-key", "Basic dXNlcjpwYXNz"],
                         ids=["no-key", "wrong-key", "not-bearer"])  # fmt: skip
@pytest.mark.parametrize(
    "content, content_type",
    [(b"{not json", "application/json"), (b"[1, 2]", "application/json"), (b"\xff\xfe", "application/json"),
     (json.dumps(CHAT).encode(), "text/plain"), (b"", None)],
    ids=["broken-json", "not-an-object", "not-utf8", "text-plain", "empty"],
)  # fmt: skip
def test_without_a_valid_key_any_body_is_a_401(stack, authorization, content, content_type):
    headers = {name: value for name, value in (("Authorization", authorization), ("Content-Type", content_type)) if value}
    for path in ("/chat/completions", "/completions"):
        response = post(stack, content=content, headers=headers, path=path)
        assert response.status_code == 401, response.text
        assert error_of(response)["code"] == "invalid_api_key"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"])
def test_a_body_that_is_not_declared_json_is_a_415(stack, content_type):
    headers = {"Authorization": f"Bearer {stack.keys['main']}", "Content-Type": content_type}
    response = post(stack, content=json.dumps(CHAT).encode(), headers=headers)
    assert response.status_code == 415, response.text
    error = error_of(response)
    assert error["type"] == "invalid_request_error" and "application/json" in error["message"]
    assert response.headers["x-request-id"] and response.headers["x-ratelimit-limit-requests"]


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON; charset=utf-8", "text/json", None])
def test_json_with_or_without_its_content_type_is_served(stack, content_type):
    headers = {"Authorization": f"Bearer {stack.keys['main']}"} | ({"Content-Type": content_type} if content_type else {})
    response = post(stack, content=json.dumps(CHAT).encode(), headers=headers)
    assert response.status_code == 200, response.text


def test_a_body_past_the_limit_is_a_413_invalid_request(stack):
    from django.conf import settings

    headers = {"Authorization": f"Bearer {stack.keys['main']}", "Content-Type": "application/json"}
    response = post(stack, content=b" " * (settings.QUILT_MAX_REQUEST_BYTES + 1), headers=headers)
    assert response.status_code == 413
    error = error_of(response)
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert response.headers["x-request-id"]


def test_an_unknown_endpoint_is_a_404_with_a_request_id(stack):
    response = httpx.post(f"{stack.gateways[0]}/embeddings", json={"model": BASE_MODEL, "input": "w1"},
                          headers={"Authorization": f"Bearer {stack.keys['main']}"})  # fmt: skip
    assert response.status_code == 404
    assert error_of(response)["code"] == "unknown_url" and response.headers["x-request-id"]


@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("GET", "/chat/completions", "POST"), ("PUT", "/completions", "POST"), ("POST", "/models", "GET"),
    ("DELETE", f"/models/{BASE_MODEL}", "GET"),
])  # fmt: skip
def test_a_wrong_method_is_a_405_saying_which_is_allowed(stack, method, path, allowed):
    response = httpx.request(method, f"{stack.gateways[0]}{path}", headers={"Authorization": f"Bearer {stack.keys['main']}"})
    assert response.status_code == 405
    assert error_of(response)["type"] == "invalid_request_error"
    assert response.headers["allow"] == allowed
