"""The engine server's generate channel (engine.contract.channel) as a gateway uses it: a real engine process on a
tiny random Llama, reached over a websocket. A request on the channel is served as POST /v1/generate serves it; a
refusal carries POST's status and body; closing the channel aborts what it carried."""

import json
import signal
import time

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from engine.contract.channel import CHANNEL_PATH, channel_read
from tests.engine.test_server import AUTH, LONG, MIX, idle, model_dir, server, stream_lines, wait_until

__all__ = ["model_dir", "server"]  # the fixtures this module shares


def channel(server, headers=AUTH):
    return connect(f"ws://127.0.0.1:{server.port}{CHANNEL_PATH}", additional_headers=headers, max_size=None)


def answer(ws, request_id: str) -> list[tuple]:
    """The channel's messages for `request_id` up to its last: (head, body) each."""
    messages = []
    while not messages or not messages[-1][0].last:
        head, body = channel_read(ws.recv(timeout=60))
        if head.request_id == request_id:
            messages.append((head, body))
    return messages


def events(messages: list[tuple]) -> list[dict]:
    return [json.loads(line) for _, body in messages for line in body.splitlines() if line]


def test_the_state_names_the_channel(server):
    assert server.get("/v1/state").json()["channel"] == CHANNEL_PATH


def test_a_generate_on_the_channel_is_served_as_a_post_serves_it(server):
    body = {
        "prompt": "the cat",
        "stream": True,
        "sampling": {"max_tokens": 6, "temperature": 0, "ignore_eos": True},
    }
    with server.stream("POST", "/v1/generate", json={**body, "request_id": "posted"}) as response:
        posted = list(stream_lines(response))
    with channel(server) as ws:
        ws.send(json.dumps({**body, "request_id": "channelled"}).encode())
        messages = answer(ws, "channelled")
    assert all(head.status == 200 for head, _ in messages)
    assert [head.last for head, _ in messages] == [False] * (len(messages) - 1) + [True]
    served = events(messages)
    assert served[-1]["type"] == "final" and all(event["type"] == "delta" for event in served[:-1])
    assert [event["request_id"] for event in served] == ["channelled"] * len(served)
    assert served[-1]["choices"] == posted[-1]["choices"]
    assert served[-1]["usage"]["completion_tokens"] == 6


def test_requests_on_one_channel_interleave_each_under_its_id(server):
    with channel(server) as ws:
        for name in ("one", "two", "three"):
            ws.send(json.dumps({"request_id": name, "prompt": f"the {name}", "stream": True,
                                "sampling": {"max_tokens": 4, "ignore_eos": True}}).encode())  # fmt: skip
        finals = {}
        while len(finals) < 3:
            head, body = channel_read(ws.recv(timeout=60))
            for event in map(json.loads, body.splitlines()):
                assert event["request_id"] == head.request_id
                if event["type"] == "final":
                    finals[head.request_id] = event
    assert {name: final["usage"]["completion_tokens"] for name, final in finals.items()} == {
        "one": 4,
        "two": 4,
        "three": 4,
    }


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "hi", "sampling": {"top_p": 1.5}}, 400, "sampling"),
        ({"prompt": "hi", "metadata": {"adapter_version_id": "seven"}}, 400, "metadata.adapter_version_id"),
        ({"prompt": "hi", "stream": False}, 400, "stream"),
    ],
    ids=["bad-value", "bad-field", "not-streamed"],
)
def test_a_refusal_on_the_channel_is_posts_answer(server, body, status, param):
    posted = server.post("/v1/generate", json={**body, "stream": True, "request_id": "p"})
    with channel(server) as ws:
        ws.send(json.dumps({**body, "request_id": "refused"}).encode())
        [(head, error)] = answer(ws, "refused")
    assert (head.status, head.last) == (status, True)
    assert json.loads(error)["error"]["param"] == param
    if param != "stream":  # the same refusal as POST's
        assert (posted.status_code, json.loads(error)) == (status, posted.json())


def test_the_channel_without_the_token_is_refused(server):
    with pytest.raises(InvalidStatus) as refused:
        channel(server, headers={"Authorization": "Bearer wrong"})
    assert refused.value.response.status_code == 403


def test_closing_the_channel_aborts_its_requests(server):
    with channel(server) as ws:
        ws.send(json.dumps({"request_id": "left", "prompt": "the cat", "stream": True,
                            "sampling": {"max_tokens": LONG, "ignore_eos": True}}).encode())  # fmt: skip
        head, _ = channel_read(ws.recv(timeout=60))
        assert (head.request_id, head.last) == ("left", False)
        assert any(r["request_id"] == "left" for r in server.get("/v1/state").json()["running_requests"])
    started = time.monotonic()
    assert wait_until(lambda: idle(server))
    assert time.monotonic() - started < 30


def test_a_graceful_shutdown_lets_the_channels_requests_finish(server):  # the last test: it stops the engine
    with channel(server) as ws:
        ws.send(json.dumps({"request_id": "landing", "prompt": "the cat", "stream": True,
                            "sampling": {"max_tokens": MIX, "ignore_eos": True}}).encode())  # fmt: skip
        head, _ = channel_read(ws.recv(timeout=60))
        assert (head.request_id, head.last) == ("landing", False)
        server.process.send_signal(signal.SIGTERM)
        final = events(answer(ws, "landing"))[-1]
    assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == MIX
    assert server.process.wait(timeout=60) in (0, -signal.SIGTERM)
