"""The health check of a static engine reads its /v1/state through the contract: a state it cannot read (a field,
another version) makes the engine unhealthy with the reason named, logged, and out of routing; a good one is stored
as plain JSON and read back as the struct."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gateway.models import Engine
from gateway.routing import routable_engines
from gateway.services import engine_check
from tests.engine_states import engine_state, engine_state_json

pytestmark = pytest.mark.django_db


@pytest.fixture
def static_engine():
    """A real HTTP server answering /v1/health, and /v1/state with whatever the test puts in `answer["state"]`."""
    answer = {"state": engine_state_json()}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "ok"} if self.path == "/v1/health" else answer["state"]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    engine = Engine.objects.create(name="static-state", url=f"http://127.0.0.1:{server.server_address[1]}", token="t")
    yield engine, answer
    server.shutdown()
    server.server_close()


def test_a_readable_state_is_stored_and_read_back(static_engine):
    engine, answer = static_engine
    answer["state"] = engine_state_json(running=3, role="decode") | {"block_size": 16}  # /v1/state says more
    engine = engine_check(engine=engine)
    assert engine.healthy and engine.role == "decode" and engine.last_error == ""
    assert engine.reported_state() == engine_state(running=3, role="decode")
    assert "block_size" not in Engine.objects.get(pk=engine.pk).state  # what is stored is the contract's state
    assert "static-state" in routable_engines().values_list("name", flat=True)


@pytest.mark.parametrize(("state", "named"), [
    (engine_state_json() | {"waiting": -1}, "`$.waiting`"),
    (engine_state_json() | {"adapters": {"gpu": []}}, "missing required field `host` - at `$.adapters`"),
    (engine_state_json() | {"v": 2}, "engine state version 2 is not the version this side speaks (1)"),
    ({"running": 0}, "missing required field"),
])  # fmt: skip
def test_a_state_that_cannot_be_read_makes_the_engine_unhealthy_naming_it(static_engine, state, named, caplog):
    engine, answer = static_engine
    assert engine_check(engine=engine).healthy
    answer["state"] = state
    engine = engine_check(engine=engine)
    assert not engine.healthy and named in engine.last_error
    assert named in caplog.text  # logged
    assert "static-state" not in routable_engines().values_list("name", flat=True)
    assert engine.reported_state() == engine_state()  # the last state it could read is kept
