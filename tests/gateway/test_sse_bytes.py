"""Streams and refusals byte for byte, as a client reads them off a real gateway (the package's stack: gateways under
uvicorn, the engine on the tiny seeded Llama, greedy): the chunks' shape and key order, the role in each choice's
first chunk, log-probabilities, the finish chunk, the usage chunk, `[DONE]`, and a refused request's body and head.

What varies between runs is normalized before the comparison, after it is checked: the request id (a uuid4's hex,
the same in the `x-request-id` header and in every chunk's id), the `created` time (one for the whole stream, now)
and the log-probabilities' values (each distinct value becomes `<lp1>`, `<lp2>`... in order of first appearance, so
a token's log-probability and the same token's entry in its top list stay equal)."""

import re
import time
import uuid

import httpx
import pytest

from tests.gateway.conftest import BASE_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

CHAT = [{"role": "user", "content": "w20 w21 w22"}]
# the platform's head after the rate-limit headers, in the order it writes them (date, server and framing aside)
TAIL_HEADERS = ["x-request-id", "x-content-type-options", "referrer-policy", "cross-origin-opener-policy"]
RATELIMIT_HEADERS = [f"x-ratelimit-{part}-{kind}" for kind in ("requests", "tokens")
                     for part in ("limit", "remaining", "reset")]  # fmt: skip
STREAM_HEADERS = ["content-type", "cache-control", "x-accel-buffering", *RATELIMIT_HEADERS, *TAIL_HEADERS]


def exchange(stack, path: str, body: dict, *, key: str = "main") -> tuple[int, list[tuple[str, str]], bytes]:
    """The status, the head as sent (names lowercased, in order) and the body's bytes of one request."""
    with httpx.stream("POST", f"{stack.gateways[0]}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {stack.keys[key]}"}) as response:  # fmt: skip
        head = [(name.decode().lower(), value.decode()) for name, value in response.headers.raw]
        return response.status_code, head, response.read()


def header_names(head: list[tuple[str, str]]) -> list[str]:
    return [name for name, _ in head if name not in ("date", "server", "transfer-encoding", "content-length")]


def normalized(body: bytes, head: list[tuple[str, str]]) -> bytes:
    request_id = dict(head)["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", request_id) and uuid.UUID(hex=request_id).version == 4, request_id
    body = body.replace(request_id.encode(), b"<id>")
    created = set(re.findall(rb'"created":(\d+)', body))
    if created:
        assert len(created) == 1, created  # one time for the whole stream
        assert abs(int(created.pop()) - time.time()) < 600
    body = re.sub(rb'"created":\d+', b'"created":<created>', body)
    labels: dict[bytes, bytes] = {}

    def label(match: re.Match) -> bytes:
        value = match.group(0)
        assert float(value) <= 0.0, value
        return labels.setdefault(value, b"<lp%d>" % (len(labels) + 1))

    return re.sub(rb"-?\d+\.\d+(?:e-?\d+)?", label, body)  # the only fractions in these bodies are log-probabilities


CHAT_STREAM_WITH_USAGE = (
    b'data: {"id":"chatcmpl-<id>","object":"chat.completion.chunk","created":<created>,"model":"tiny","system_fingerprint":null,"choices":[{"index":0,"delta":{"role":"assistant","content":" w122"},"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
    b'data: {"id":"chatcmpl-<id>","object":"chat.completion.chunk","created":<created>,"model":"tiny","system_fingerprint":null,"choices":[{"index":0,"delta":{"content":" w106"},"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
    b'data: {"id":"chatcmpl-<id>","object":"chat.completion.chunk","created":<created>,"model":"tiny","system_fingerprint":null,"choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":"length"}],"usage":null}\n\n'
    b'data: {"id":"chatcmpl-<id>","object":"chat.completion.chunk","created":<created>,"model":"tiny","system_fingerprint":null,"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11,"prompt_tokens_details":{"cached_tokens":0},"completion_tokens_details":{"reasoning_tokens":0}}}\n\n'
    b"data: [DONE]\n\n"
)  # fmt: skip


def test_a_chat_stream_with_its_usage_chunk(stack):
    status, head, body = exchange(stack, "/chat/completions", {
        "model": BASE_MODEL, "messages": CHAT, "max_tokens": 2, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    })  # fmt: skip
    assert status == 200, body
    assert header_names(head) == STREAM_HEADERS
    assert dict(head)["content-type"] == "text/event-stream"
    assert normalized(body, head) == CHAT_STREAM_WITH_USAGE


CHAT_STREAM_WITH_LOGPROBS = (
    b'data: {"id":"chatcmpl-<id>","object":"chat.completion.chunk","created":<created>,"model":"tiny","system_fingerprint":null,"choices":[{"index":0,"delta":{"role":"assistant","content":" w122"},"logprobs":{"content":[{"token":"w122","logprob":<lp1>,"bytes":[119,49,50,50],"top_logprobs":[{"token":"w122","logprob":<lp1>,"bytes":[119,49,50,50]},{"token":"w136","logprob":<lp2>,"bytes":[119,49,51,54]}]}],"refusal":null},"finish_reason":null}]}\n\n'
    b'data: {"id":"chatcmpl-<id>","object":"chat.completion.chunk","created":<created>,"model":"tiny","system_fingerprint":null,"choices":[{"index":0,"delta":{"content":" w106"},"logprobs":{"content":[{"token":"w106","logprob":<lp3>,"bytes":[119,49,48,54],"top_logprobs":[{"token":"w106","logprob":<lp3>,"bytes":[119,49,48,54]},{"token":"w20","logprob":<lp4>,"bytes":[119,50,48]}]}],"refusal":null},"finish_reason":null}]}\n\n'
    b'data: {"id":"chatcmpl-<id>","object":"chat.completion.chunk","created":<created>,"model":"tiny","system_fingerprint":null,"choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":"length"}]}\n\n'
    b"data: [DONE]\n\n"
)  # fmt: skip


def test_a_chat_stream_with_logprobs(stack):
    status, head, body = exchange(stack, "/chat/completions", {
        "model": BASE_MODEL, "messages": CHAT, "max_tokens": 2, "temperature": 0, "stream": True, "logprobs": True,
        "top_logprobs": 2,
    })  # fmt: skip
    assert status == 200, body
    assert normalized(body, head) == CHAT_STREAM_WITH_LOGPROBS


COMPLETION_STREAM_WITH_ECHO_AND_LOGPROBS = (
    b'data: {"id":"cmpl-<id>","object":"text_completion","created":<created>,"model":"tiny","system_fingerprint":null,"choices":[{"index":0,"text":"w10 w11 w135","logprobs":{"tokens":["w10","w11","w135"],"token_logprobs":[null,<lp1>,<lp2>],"top_logprobs":[null,{"w148":<lp3>},{"w135":<lp2>}],"text_offset":[0,3,6]},"finish_reason":null}]}\n\n'
    b'data: {"id":"cmpl-<id>","object":"text_completion","created":<created>,"model":"tiny","system_fingerprint":null,"choices":[{"index":0,"text":" w122","logprobs":{"tokens":["w122"],"token_logprobs":[<lp4>],"top_logprobs":[{"w122":<lp4>}],"text_offset":[12]},"finish_reason":null}]}\n\n'
    b'data: {"id":"cmpl-<id>","object":"text_completion","created":<created>,"model":"tiny","system_fingerprint":null,"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length"}]}\n\n'
    b"data: [DONE]\n\n"
)  # fmt: skip


def test_a_completion_stream_with_echo_and_logprobs(stack):
    status, head, body = exchange(stack, "/completions", {
        "model": BASE_MODEL, "prompt": "w10 w11", "max_tokens": 2, "temperature": 0, "stream": True, "logprobs": 1,
        "echo": True,
    })  # fmt: skip
    assert status == 200, body
    assert normalized(body, head) == COMPLETION_STREAM_WITH_ECHO_AND_LOGPROBS


REFUSALS = {
    "bad-parameter": ("main", {"temperature": 3}, 400,
                      b'{"error": {"message": "3 is not a valid value for \'temperature\': it must be between 0 and 2.", "type": "invalid_request_error", "param": "temperature", "code": null}}'),
    "unknown-model": ("main", {"model": "no-such-model"}, 404,
                      b'{"error": {"message": "The model \'no-such-model\' does not exist or you do not have access to it.", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}'),
    "budget": ("broke", {"max_tokens": 2}, 429,
               b'{"error": {"message": "You exceeded your monthly token budget: this request may need up to 11 tokens.", "type": "insufficient_quota", "param": null, "code": "insufficient_quota"}}'),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSALS)
def test_a_refused_stream_is_one_json_error_not_an_event_stream(stack, case):
    key, extra, status, expected = REFUSALS[case]
    got, head, body = exchange(stack, "/chat/completions",
                               {"model": BASE_MODEL, "messages": CHAT, "stream": True} | extra, key=key)  # fmt: skip
    assert got == status and body == expected
    names = header_names(head)
    assert names == ["content-type", *RATELIMIT_HEADERS, *(["retry-after"] if status == 429 else []), *TAIL_HEADERS]
    assert dict(head)["content-type"] == "application/json"
    if status == 429:
        assert int(dict(head)["retry-after"]) > 0
