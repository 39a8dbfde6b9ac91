"""A Redis outage that starts while a request is served does not take away what the client was served.

The gateway settles a request's hold in Redis once its engine has answered (a whole answer's before it is sent, a
stream's after its end has left). When Redis goes away meanwhile, or stops answering (paused), the settle gives up
after QUILT_REDIS_REPLY_TIMEOUT_SECONDS and the answer ends as served: a stream with its body's end after [DONE], a
whole answer with its 200 (not a 503 for an answer generated and billed by the engine's usage event). The hold
waits for metering's settle of the engine's usage event, or for its TTL."""

import json
import signal
import threading
import time

import httpx
import pytest

from tests.gateway.conftest import ENGINE_TOKEN, free_port, launch_gateway, stop, wait_for_gateway, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

PROMPT = "w10 w11 w12"
# eight choices of 200 tokens: some 0.4 s of generation after the first text here (longer on a busier machine),
# for Redis to go away in between the request's admission and its settle
LONG = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "n": 8}


@pytest.fixture
def gateway(stack, private_redis, tmp_path, request):
    """A gateway of the stack's whose Redis (admission, caches) is `private_redis`, which a test may stop; with the
    parameter "options", its URL has a query string (redis-py's options)."""
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
    events = []
    with httpx.stream("POST", f"{url}/completions", json=LONG | {"stream": True}, headers=headers,
                      timeout=60) as response:  # fmt: skip
        assert response.status_code == 200
        lines = response.iter_lines()
        events.append(next(line for line in lines if line))
        private_redis.stop()  # the hold was taken; its settle, at the answer's end, finds no Redis
        events += [line for line in lines if line]  # a RemoteProtocolError where the body's end never comes
    assert events[-1] == "data: [DONE]"
    finishes = [choice["finish_reason"] for event in events[:-1] for choice in json.loads(event[6:])["choices"]
                if choice["finish_reason"]]  # fmt: skip
    assert len(finishes) == 8 and set(finishes) <= {"length", "stop"}
    wait_until(lambda: "could not settle" in log.read_text(), timeout=10, what="the settle's failure logged")


@pytest.mark.parametrize("gateway", ["plain", "options"], indirect=True)
def test_a_stream_whose_redis_stops_answering_still_ends(stack, private_redis, gateway):
    # A Redis that is paused (SIGSTOP here; a stalled failover, a partition without resets) keeps its connections
    # open and never answers the settle: it gives up after QUILT_REDIS_REPLY_TIMEOUT_SECONDS (1 s here), whatever
    # the URL's options; the stream's end does not wait for it (tests/gateway/test_stream_end.py).
    url, log = gateway
    headers = {"Authorization": f"Bearer {stack.keys['main']}"}
    events = []
    try:
        with httpx.stream("POST", f"{url}/completions", json=LONG | {"stream": True}, headers=headers,
                          timeout=20) as response:  # fmt: skip
            assert response.status_code == 200
            lines = response.iter_lines()
            events.append(next(line for line in lines if line))
            private_redis.process.send_signal(signal.SIGSTOP)  # admitted; the settle is still to come
            events += [line for line in lines if line]
        ended = time.monotonic()
        wait_until(lambda: "could not settle" in log.read_text(), timeout=10, what="the settle giving up")
        gave_up = time.monotonic() - ended  # Redis was paused when the settle came
    finally:
        private_redis.process.send_signal(signal.SIGCONT)
    assert events[-1] == "data: [DONE]"
    assert gave_up < 4.0, gave_up  # some 1 s after the stream's end


def test_a_whole_answer_generated_while_redis_stops_answering_is_answered(stack, private_redis, gateway):
    url, log = gateway
    headers = {"Authorization": f"Bearer {stack.keys['main']}"}
    answers = []
    asking = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{url}/completions", json=LONG, headers=headers, timeout=20)))  # fmt: skip
    try:
        asking.start()
        _until_generating(stack.engine_url, answers)
        private_redis.process.send_signal(signal.SIGSTOP)  # admitted, generating: the settle is still to come
        asking.join(30)
    finally:
        private_redis.process.send_signal(signal.SIGCONT)
    assert answers, "no answer"
    answer = answers[0]
    assert answer.status_code == 200, answer.text  # not a 503 (or no answer): the answer generated and billed
    assert len(answer.json()["choices"]) == 8
    assert "could not settle" in log.read_text()


def _until_generating(engine_url: str, answers: list) -> None:
    """Returns once the engine runs a request (the gateway admitted it), polled every few milliseconds: `LONG`
    generates for some 0.4 s here, longer on a busier machine."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not answers:
        text = httpx.get(f"{engine_url}/metrics", headers={"Authorization": f"Bearer {ENGINE_TOKEN}"}, timeout=5).text
        if any(line.startswith("quilt_engine_running_requests ") and float(line.split()[1]) > 0
               for line in text.splitlines()):  # fmt: skip
            return
        time.sleep(0.005)
    pytest.fail("the engine never ran the request")
