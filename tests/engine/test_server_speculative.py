"""The engine server with speculative decoding on: what its generate answers report about speculation, streamed
and not, equals what its usage event carries."""

import uuid

import pytest

from tests.engine.conftest import launch_engine_server, wait_until_healthy
from tests.engine.test_server import (
    BROKER,
    TOKEN,
    generate,
    model_dir,
    stream_lines,
    usage_events,
)

__all__ = ["model_dir"]  # the tiny checkpoint fixture, shared with test_server

SPEC_FIELDS = ("spec_proposed_tokens", "spec_accepted_tokens", "sampling_steps")


@pytest.fixture(scope="module")
def spec_server(model_dir, tmp_path_factory):
    """The draft is the model itself: every proposal for a base-model request is accepted."""
    queue_name = f"usage-spec-server-test-{uuid.uuid4().hex}"
    log_path = tmp_path_factory.mktemp("spec-engine-log") / "engine.log"
    client = launch_engine_server(
        ["--model", str(model_dir), "--broker-url", BROKER, "--usage-queue", queue_name,
         "--usage-spool", str(log_path.parent / "u.jsonl"), "--speculative-method", "draft",
         "--speculative-model", str(model_dir), "--num-speculative-tokens", "3", "--speculative-min-acceptance", "0",
         "--log-level", "warning"],
        log_path=log_path, token=TOKEN)  # fmt: skip
    process = client.process
    try:
        wait_until_healthy(process, client, log_path)
        client.queue_name = queue_name
        yield client
    finally:
        process.kill()
        process.wait()
        client.close()


def test_streamed_and_whole_answers_report_speculation_like_the_usage_event(spec_server):
    body = {"prompt": "the cat sees a dog", "sampling": {"temperature": 0, "max_tokens": 12, "ignore_eos": True}}
    whole = generate(spec_server, request_id="spec-whole", **body)
    with spec_server.stream("POST", "/v1/generate", json={"request_id": "spec-stream", "stream": True, **body}) as r:
        assert r.status_code == 200
        final = list(stream_lines(r))[-1]
    assert final["type"] == "final"
    events = usage_events(spec_server, request_ids={"spec-whole", "spec-stream"})
    for answer, request_id in ((whole["usage"], "spec-whole"), (final["usage"], "spec-stream")):
        reported = {name: answer[name] for name in SPEC_FIELDS}
        assert reported == {name: events[request_id][name] for name in SPEC_FIELDS}
        assert reported["spec_accepted_tokens"] == reported["spec_proposed_tokens"] > 0  # the draft is the model
        assert answer["completion_tokens"] == 12 > reported["sampling_steps"] > 0  # several tokens a step
    assert {name: whole["usage"][name] for name in SPEC_FIELDS} == {name: final["usage"][name] for name in SPEC_FIELDS}
