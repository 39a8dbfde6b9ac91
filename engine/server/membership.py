"""An engine that manages its own place in the fleet: it joins the control plane, heartbeats its capacity, load,
adapters and prompt fingerprints every `interval_s`, and on SIGTERM leaves before it drains.

    POST {control_plane}/internal/engines/heartbeat   Authorization: Bearer <engine token>
    engine.contract.state.Heartbeat: {"name", "url", "pool", "gpu_price_per_hour", "interval_s", "draining",
    "state": EngineState, "v"}

The control plane takes an engine out of routing when HEARTBEAT_MISSES heartbeats in a row have not come, or at
once when one says `draining`. `Draining` wraps uvicorn's server: on SIGTERM it says so to the control plane, keeps
serving for `grace_s` (every gateway re-reads its engines within a second: requests already on their way still
land), then refuses new requests (503: the gateway retries them elsewhere), waits for the running ones to finish and
exits.
"""

import asyncio
import collections
import contextlib
import logging
from dataclasses import dataclass

import httpx
import msgspec
import uvicorn

from engine.contract import prompt_fingerprints
from engine.contract.state import Heartbeat
from engine.server.channel import GenerateChannel
from engine.server.engine_loop import EngineLoop
from engine.server.protocol import GenerateRequest

log = logging.getLogger(__name__)

FINGERPRINTS_KEPT = 4096  # prompt fingerprints remembered, most recent first out of the heartbeat
FINGERPRINTS_SENT = 512  # of them, the most recent, in each heartbeat


class RecentPrefixes:
    """The prompt fingerprints of what this engine served lately (least recently used forgotten first): a summary
    of what its KV prefix cache is likely to hold, at a few KiB per heartbeat."""

    def __init__(self, capacity: int = FINGERPRINTS_KEPT) -> None:
        self.capacity = capacity
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()

    def record(self, request: GenerateRequest) -> None:
        adapter = request.adapter and request.adapter.digest
        for prompt in request.prompts:
            for fingerprint in prompt_fingerprints(tenant=request.tenant, adapter=adapter, prompt=prompt.text,
                                                   messages=prompt.messages):
                self._seen[fingerprint] = None
                self._seen.move_to_end(fingerprint)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def recent(self, count: int = FINGERPRINTS_SENT) -> list[str]:
        return list(reversed(self._seen))[:count]


@dataclass(frozen=True)
class Identity:
    control_plane: str  # base URL of the control plane (any gateway process)
    name: str
    url: str  # where gateways reach this engine
    pool: str
    gpu_price_per_hour: str
    token: str
    interval_s: float


class Membership:
    """The heartbeat loop and the goodbye."""

    def __init__(self, identity: Identity, loop: EngineLoop, prefixes: RecentPrefixes) -> None:
        self.identity = identity
        self.loop = loop
        self.prefixes = prefixes
        self.draining = False
        self._task: asyncio.Task | None = None
        self._client: httpx.AsyncClient | None = None  # one connection kept for every beat
        self._joined = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="heartbeat")

    async def leave(self) -> None:
        """Tells the control plane this engine is draining (it leaves routing at once) and stops heartbeating."""
        self.draining = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            for _ in range(3):  # the goodbye matters more than a heartbeat: retried, with more time
                if await self.beat(timeout_s=5.0):
                    return
        finally:
            if self._client is not None:
                await self._client.aclose()

    async def _run(self) -> None:
        """A beat every `interval_s`, start to start: a slow answer delays the next beat only by what it took past
        the interval. Sleeping a whole interval after each answer would stretch the period by every answer's time: on a
        loaded machine, past the HEARTBEAT_MISSES intervals the control plane allows, and the engine would leave
        routing while it serves."""
        clock = asyncio.get_running_loop()
        while True:
            started = clock.time()
            await self.beat()
            await asyncio.sleep(max(0.0, started + self.identity.interval_s - clock.time()))

    async def beat(self, timeout_s: float | None = None) -> bool:
        identity = self.identity
        prefixes = self.prefixes.recent()  # read here: the event loop records them
        try:
            state = await self.loop.call(lambda engine: self.loop.state(model=self.loop.base_model, prefixes=prefixes))
        except Exception as error:  # the engine loop stopped: no heartbeat, the control plane times us out
            log.warning("no heartbeat: the engine's state could not be read: %s", error)
            return False
        heartbeat = Heartbeat(name=identity.name, url=identity.url, pool=identity.pool,
                              gpu_price_per_hour=identity.gpu_price_per_hour, interval_s=identity.interval_s,
                              draining=self.draining or not self.loop.accepting, state=state)
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=max(1.0, identity.interval_s))
        try:
            response = await self._client.post(f"{identity.control_plane}/internal/engines/heartbeat",
                                               content=msgspec.json.encode(heartbeat),
                                               headers={"Authorization": f"Bearer {identity.token}",
                                                        "Content-Type": "application/json"},
                                               timeout=timeout_s or httpx.USE_CLIENT_DEFAULT)  # fmt: skip
        except httpx.HTTPError as error:
            log.warning("heartbeat to %s failed: %s", identity.control_plane, error)
            return False
        if response.status_code != 200:
            log.warning("heartbeat refused by %s: %d %s", identity.control_plane, response.status_code,
                        response.text[:300])
            return False
        if not self._joined:
            log.info("joined the fleet at %s as %s (%s)", identity.control_plane, identity.name, identity.url)
            self._joined = True
        return True


class Draining(uvicorn.Server):
    """uvicorn's server with a fleet-aware shutdown: leave routing, let in-flight requests land, then drain."""

    def __init__(self, config: uvicorn.Config, *, loop: EngineLoop, membership: Membership | None,
                 grace_s: float, channel: GenerateChannel | None = None) -> None:
        super().__init__(config)
        self.engine_loop = loop
        self.membership = membership
        self.grace_s = grace_s
        self.channel = channel

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.membership is not None and not self.should_exit:
            self.membership.start()  # joins once it listens: no gateway is sent here before it can answer

    async def shutdown(self, sockets=None) -> None:
        if self.membership is not None:
            log.info("draining: leaving the fleet, still serving for %.1f s", self.grace_s)
            await self.membership.leave()
            await asyncio.sleep(self.grace_s)
        self.engine_loop.accepting = False  # new requests: 503, which a gateway retries on another engine
        if self.channel is not None:  # the server's shutdown closes the channels at once: their requests land first
            await self.channel.drained(self.config.timeout_graceful_shutdown)
        await super().shutdown(sockets)
