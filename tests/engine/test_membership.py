"""An engine's heartbeats to a control plane that answers slowly (a real HTTP server on uvicorn, as a loaded gateway
is): the beats still leave every `interval_s`, start to start, so a slow answer does not stretch the gaps past what
the control plane allows before it takes the engine out of routing; and they share one connection. The goodbye
(`draining`) comes last."""

import asyncio
import time

import uvicorn

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.server.engine_loop import EngineLoop
from engine.server.membership import Identity, Membership, RecentPrefixes
from engine.server.metrics import EngineMetrics
from tests.ports import free_port

INTERVAL = 1.0
ANSWER_SECONDS = 0.6  # each heartbeat's answer: most of an interval, shorter than the client's timeout (1 s)


class SlowControlPlane:
    """Answers each heartbeat after ANSWER_SECONDS; keeps when each arrived and from which connection."""

    def __init__(self) -> None:
        self.arrivals: list[float] = []
        self.clients: list[tuple[str, int]] = []
        self.draining: list[bool] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        self.arrivals.append(time.monotonic())
        self.clients.append(tuple(scope["client"]))
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.draining.append(b'"draining":true' in body.replace(b" ", b""))
        await asyncio.sleep(ANSWER_SECONDS)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})


def test_heartbeats_keep_their_interval_when_the_control_plane_answers_slowly(checkpoints):
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=4, num_kv_blocks=32))
    loop = EngineLoop(engine, metrics=EngineMetrics(), emitter=None, base_model="tiny")
    control_plane, port = SlowControlPlane(), free_port()

    async def run() -> None:
        loop.start(asyncio.get_running_loop())
        server = uvicorn.Server(uvicorn.Config(control_plane, host="127.0.0.1", port=port, log_level="warning"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        identity = Identity(control_plane=f"http://127.0.0.1:{port}", name="slow-1", url="http://127.0.0.1:1",
                            pool="default", gpu_price_per_hour="1", token="t", interval_s=INTERVAL)  # fmt: skip
        membership = Membership(identity, loop, RecentPrefixes())
        membership.start()
        await asyncio.sleep(5.5)
        await membership.leave()
        server.should_exit = True
        await serving

    try:
        asyncio.run(run())
    finally:
        loop.shutdown(drain_timeout_s=0.0)  # the engine's too
    arrivals = control_plane.arrivals
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)]
    assert len(gaps) >= 3 and control_plane.draining[-1] and not any(control_plane.draining[:-1])
    # start to start: an interval (the answer's time inside it), not the answer's time plus a whole interval (1.6 s)
    assert max(gaps) < INTERVAL + ANSWER_SECONDS / 2, gaps
    # one kept connection, not a new client per beat (the goodbye may need another: leaving cancels a beat in flight)
    assert len(set(control_plane.clients[:-1])) == 1, control_plane.clients
