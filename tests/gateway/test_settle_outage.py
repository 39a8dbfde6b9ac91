"""A Redis outage that starts while a request is served does not take away what the client was served.

The gateway settles a request's hold in Redis once its engine has answered, before the client reads the answer's
end. When Redis went away meanwhile, the settle failed and the failure reached the client: a stream served whole was
cut after its [DONE], without its body's end (an HTTP client reading to the end failed), and a whole answer already
generated became a 503, billed all the same by the engine's usage event. A Redis that stopped answering (paused)
hung the request for ever. Now the settle gives up after QUILT_REDIS_REPLY_TIMEOUT_SECONDS, and the answer ends as
served; the hold waits for metering's settle of the engine's usage event, or for its TTL."""

import concurrent.futures
import json
import signal
import time

import httpx
import pytest

from tests.gateway.conftest import free_port, launch_gateway, stop, wait_for_gateway

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

PROMPT = "w10 w11 w12"


@pytest.fixture
def gateway(stack, private_redis, tmp_path, request):
    """A gateway of the stack's whose Redis (admission, caches) is `private_redis`, which a test may stop; with the
    parameter "options", its URL has a query string, so admission runs on redis-py rather than the gateway's wire."""
    port = free_port()
    url = private_redis.url + ("?db=0" if getattr(request, "param", "") == "options" else "")
    env = stack.env | {"REDIS_URL": url, "QUILT_REDIS_REPLY_TIMEOUT_SECONDS": "1"}
    process = launch_gateway(env, port, tmp_path / "gateway.log")
    try:
        wait_for_gateway(process)
        yield f"http://127.0.0.1:{port}/v1", tmp_path / "gateway.log"
    finally:
        stop(process)


def test_a_stream_served_while_redis_goes_away_still_ends_whole(stack, private_redis, gateway):
    url, log = gateway
    headers = {"Authorization": f"Bearer {stack.keys['main']}"}
    # eight choices of 200 tokens: some 0.4 s of generation after the first text, for the stop to land in
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True, "n": 8}
    events = []
    with httpx.stream("POST", f"{url}/completions", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        events.append(next(line for line in lines if line))
        private_redis.stop()  # the hold was taken; its settle, at the answer's end, finds no Redis
        events += [line for line in lines if line]  # raised before (RemoteProtocolError): the body's end never came
    assert events[-1] == "data: [DONE]"
    finishes = [choice["finish_reason"] for event in events[:-1] for choice in json.loads(event[6:])["choices"]
                if choice["finish_reason"]]  # fmt: skip
    assert len(finishes) == 8 and set(finishes) <= {"length", "stop"}
    assert "could not settle" in log.read_text()


@pytest.mark.parametrize("gateway", ["plain", "options"], indirect=True)
def test_a_stream_whose_redis_stops_answering_still_ends(stack, private_redis, gateway):
    # A Redis that is paused (SIGSTOP here; a stalled failover, a partition without resets) accepts the settle and
    # never answers: on the gateway's own wire the stream waited for ever after its last text (redis-py, for URLs
    # with options, gave up after its default 5 s). Now the settle gives up after QUILT_REDIS_REPLY_TIMEOUT_SECONDS
    # (1 s here) on either, and the stream ends as served.
    url, log = gateway
    headers = {"Authorization": f"Bearer {stack.keys['main']}"}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "temperature": 0}
    events = []  # (arrival, line)
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=20) as http:
            _lease_taken(http, body)
            private_redis.process.send_signal(signal.SIGSTOP)
            with http.stream("POST", "/completions", json=body | {"stream": True}) as response:
                assert response.status_code == 200
                events += [(time.monotonic(), line) for line in response.iter_lines() if line]  # ReadTimeout before
    finally:
        private_redis.process.send_signal(signal.SIGCONT)
    assert events[-1][1] == "data: [DONE]"
    # the answer's end leaves once the settle gave up: after the last text, by about the timeout
    finish = next(number for number, (_, line) in enumerate(events) if '"finish_reason":"' in line)
    waited = events[finish][0] - events[finish - 1][0]
    assert 0.5 < waited < 4.0, waited
    assert "could not settle" in log.read_text()


def test_a_whole_answer_generated_while_redis_goes_away_is_answered(stack, private_redis, gateway):
    # Paused before the request (its connections stay open, so nothing notices until a command waits): the request
    # is admitted from the key's lease, and only its settle finds Redis gone.
    url, log = gateway
    headers = {"Authorization": f"Bearer {stack.keys['main']}"}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "temperature": 0}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=20) as http:
            _lease_taken(http, body)
            private_redis.process.send_signal(signal.SIGSTOP)
            answer = http.post("/completions", json=body)
    finally:
        private_redis.process.send_signal(signal.SIGCONT)
    assert answer.status_code == 200, answer.text  # was 503 (or no answer): the answer generated, and billed, lost
    assert answer.json()["choices"][0]["text"]
    assert "could not settle" in log.read_text()


def _lease_taken(http: httpx.Client, body: dict) -> None:
    """Makes the key busy in the gateway, which then admits its next requests like `body` (the lease holds their
    estimates) from a lease of its limits taken ahead, with no Redis call, and keeps the key verified in memory: so
    Redis can stop answering before a request, and only that request's settle finds it gone."""
    assert http.post("/completions", json=body).status_code == 200  # admission's month started in Redis
    with concurrent.futures.ThreadPoolExecutor(12) as pool:  # busy: a lease is taken within the second
        assert {r.status_code for r in pool.map(lambda _: http.post("/completions", json=body), range(12))} == {200}
