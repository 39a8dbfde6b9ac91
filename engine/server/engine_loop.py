"""The engine's own thread: it alone touches the LLMEngine; the event loop talks to it by commands.

Commands (`call`) run between steps and hand their result back as an awaitable; outputs go to
each request's asyncio queue with `call_soon_threadsafe`. When a request ends — finished,
stopped, aborted or failed — the thread records metrics and emits its one usage event.
"""

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.contract.channel import CHANNEL_PATH
from engine.contract.state import (
    AdapterResidency,
    Adapters,
    EngineState,
    LastStep,
    LoadSeconds,
    Memory,
    PoolCounts,
    RequestOnEngine,
    StateAnswer,
)
from engine.contract.usage import UsageEvent, now_utc
from engine.grammar import Grammar
from engine.images import ImageFeatures
from engine.kv.lease import Lease
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, Usage, merge_choices, sum_usage
from engine.server.metrics import EngineMetrics, adapter_label
from engine.server.protocol import BadRequest, GenerateRequest
from engine.tool_calls import ToolCallFormat, ToolCallStream
from engine.usage.emitter import UsageEmitter

log = logging.getLogger(__name__)
RATE_WINDOW_S = 5.0
API_TIER = {"device": "gpu", "host": "host"}  # the pool's tiers as the API and metrics name them


class Conflict(Exception):
    """The request clashes with the engine's state (409)."""


class Unavailable(Exception):
    """The engine is shutting down or broken (503)."""


@dataclass
class RequestHandle:
    """A request as the server sees it; its queue receives ("output", RequestOutput) items, then
    one ("end", RequestEnd)."""

    request: GenerateRequest
    prompts: list[list[int]]  # token ids of each prompt (a batch runs as one engine request per prompt)
    arrival: float  # time.monotonic() when the server received it
    images: list[list[ImageFeatures]] = field(default_factory=list)  # each prompt's images, in order (none: [])
    grammar: Grammar | None = None  # compiled before it was submitted
    tool_format: ToolCallFormat | None = None  # its output is parsed for tool calls in this convention
    tool_streams: dict[int, ToolCallStream] = field(default_factory=dict)  # index -> its calls, as streamed
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: dict[int, RequestOutput] = field(default_factory=dict)
    last_token_time: dict[int, float] = field(default_factory=dict)
    aborted: bool = False
    lease: Lease | None = None  # a prefill hop's (kv_transfer mode "prefill"), granted as it ends
    kv_pull: Any = None  # a decode hop's engine.server.kv_transfer.PullReport, for its usage
    adapter_wait_s: float = 0.0  # how long it waited for its adapter's first read before it was submitted

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def adapter(self) -> str | None:
        return self.request.adapter.digest if self.request.adapter else None

    @property
    def engine_request_ids(self) -> list[str]:
        """The engine's id for each prompt: the request's own for one, `id#p` (no client id has a '#') for a batch."""
        if len(self.prompts) == 1:
            return [self.request_id]
        return [f"{self.request_id}#{p}" for p in range(len(self.prompts))]

    @property
    def num_completions(self) -> int:
        return len(self.prompts) * self.request.sampling.n


@dataclass(frozen=True)
class RequestEnd:
    finish_reason: str
    usage: Usage
    e2e_ms: float
    outputs: list[RequestOutput]  # final output of each completion, by index


class EngineLoop:
    def __init__(self, engine: LLMEngine, *, metrics: EngineMetrics, emitter: UsageEmitter | None,
                 base_model: str) -> None:
        self.engine = engine
        self.metrics = metrics
        self.emitter = emitter
        self.base_model = base_model
        self.handles: dict[str, RequestHandle] = {}  # engine thread only
        self.leases = engine.leases  # engine thread only: KV blocks kept for other engines
        self.routes: dict[str, tuple[RequestHandle, int]] = {}  # engine request id -> its handle, prompt index
        self.accepting = True
        self.healthy = True
        self.last_step: dict[str, Any] = {"sequences": 0, "adapters": []}
        self._commands: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._step_times: collections.deque[tuple[float, int]] = collections.deque()  # (when, tokens)
        self._tiers = self._resident()
        self._adapter_waits: dict[str, float] = {}  # request id -> when it began to wait in the engine for its adapter
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # the event loop's side
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) in the engine thread between steps; its result or exception comes back."""
        if not self._thread.is_alive():
            raise Unavailable("the engine loop is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    async def submit(self, request: GenerateRequest, prompts: list[list[int]], *, arrival: float,
                     grammar: Grammar | None = None, tool_format: ToolCallFormat | None = None,
                     kv_pull: Any = None, aborted: bool = False, adapter_wait_s: float = 0.0,
                     images: list[list[ImageFeatures]] | None = None) -> RequestHandle:
        """aborted: the request was aborted before it could start (during its KV pull): it is added and aborted in
        one command, so it ends as any aborted request does (its final event and usage event) without a step.
        adapter_wait_s: the time it already waited for its adapter (AdapterRegistry.ensure)."""
        if not self.accepting:
            raise Unavailable("the engine is shutting down")
        failure = self.engine.failure()
        if failure is not None:  # a tensor-parallel rank died: no step can run
            raise Unavailable(failure)
        handle = RequestHandle(request=request, prompts=prompts, arrival=arrival, grammar=grammar,
                               tool_format=tool_format, kv_pull=kv_pull, adapter_wait_s=adapter_wait_s,
                               images=images or [])
        await self.call(lambda engine: (self._add(handle), aborted and self._abort(handle.request_id)))
        return handle

    async def abort(self, request_id: str) -> bool:
        return await self.call(lambda engine: self._abort(request_id))

    def abort_soon(self, request_id: str) -> None:
        """Abort without waiting (used when a client goes away)."""
        self._commands.put((lambda engine: self._abort(request_id), concurrent.futures.Future()))

    def shutdown(self, *, drain_timeout_s: float) -> None:
        """Stop taking requests, let running ones finish for a while, abort the rest, flush usage."""
        self.accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._thread.is_alive() and self.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._thread.is_alive():
            done: concurrent.futures.Future = concurrent.futures.Future()
            self._commands.put((lambda engine: [self._abort(rid) for rid in list(self.handles)], done))
            done.result(timeout=30)
            self._stop.set()
            self._commands.put((lambda engine: None, concurrent.futures.Future()))
            self._thread.join(timeout=30)
        self.engine.shutdown()
        if self.emitter is not None:
            self.emitter.close()

    # the engine thread
    def _run(self) -> None:
        while not self._stop.is_set():
            self._run_commands(block=not self.engine.has_unfinished())
            failure = self.engine.failure()
            if failure is not None and self.healthy:  # a tensor-parallel worker died, maybe while idle
                log.error("engine unhealthy: %s", failure)
                self.healthy = False
                self._fail_all(failure)
            if self._stop.is_set() or not self.engine.has_unfinished():
                continue
            steps_before = self.engine.num_steps
            started = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception:
                log.exception("engine step failed; failing every request in flight")
                self.healthy = False
                self._fail_all(self.engine.failure() or "engine step failed")
                continue
            self._observe_adapter_waits()
            if self.engine.num_steps > steps_before:
                self._observe_step(time.perf_counter() - started, outputs)
            for output in outputs:
                self._dispatch(output)
            if not outputs:
                time.sleep(0.001)  # nothing runnable yet: adapters are loading
        self._stop.set()

    def _run_commands(self, *, block: bool) -> None:
        try:
            fn, future = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except Exception as error:  # handed back to the awaiting handler
                    future.set_exception(error)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                break
        self._track_adapter_tiers()
        self.metrics.observe_adapter_loads(self.engine.adapter_pool)

    def _add(self, handle: RequestHandle) -> None:
        request = handle.request
        if request.request_id in self.handles:
            raise Conflict(f"request {request.request_id!r} is already running")
        adapter = handle.adapter
        if adapter is not None and self.engine.adapter_pool.is_registered(adapter):
            tier = API_TIER.get(self.engine.adapter_pool.tier(adapter), "disk")
            self.metrics.adapter_requests.labels(adapter=adapter_label(adapter), tier=tier).inc()
        added = []
        try:
            for p, (engine_id, prompt) in enumerate(zip(handle.engine_request_ids, handle.prompts, strict=True)):
                self.engine.add_request(engine_id, prompt, request.sampling, adapter=adapter, tenant=request.tenant,
                                        weight=request.weight, grammar=handle.grammar,
                                        images=handle.images[p] if handle.images else ())
                added.append(engine_id)
        except ValueError as error:
            for engine_id in added:  # nothing half-added
                self.engine.abort(engine_id)
            raise BadRequest(str(error)) from error
        self.handles[request.request_id] = handle
        for p, engine_id in enumerate(added):
            self.routes[engine_id] = (handle, p)
        if adapter is not None:
            if self._in_memory(adapter):
                self.metrics.adapter_wait_seconds.observe(handle.adapter_wait_s)
            else:
                self._adapter_waits[request.request_id] = time.monotonic()

    def _in_memory(self, digest: str) -> bool:
        return self.engine.adapter_pool.tier(digest) in ("device", "host")

    def _observe_adapter_waits(self) -> None:
        """Requests whose adapter is in memory now stop waiting for it."""
        now = time.monotonic()
        for request_id, since in list(self._adapter_waits.items()):
            handle = self.handles[request_id]
            if self._in_memory(handle.adapter):
                del self._adapter_waits[request_id]
                self.metrics.adapter_wait_seconds.observe(handle.adapter_wait_s + now - since)

    def _abort(self, request_id: str) -> bool:
        handle = self.handles.get(request_id)
        if handle is None:  # a prefill hop that has ended: its lease, granted as its caller left, ends here
            return self.leases.release_request(request_id)
        handle.aborted = True
        for engine_id in handle.engine_request_ids:
            for output in self.engine.abort(engine_id):
                self._dispatch(output)
        return True

    def _fail_all(self, message: str) -> None:
        for output in self.engine.fail_all(message):
            self._dispatch(output)

    def _dispatch(self, output: RequestOutput) -> None:
        route = self.routes.get(output.request_id)
        if route is None:
            return
        handle, p = route
        if len(handle.prompts) > 1:  # a batch's completion, as the client counts them
            output = dataclasses.replace(output, request_id=handle.request_id,
                                         index=p * handle.request.sampling.n + output.index)
        now = time.monotonic()
        labels = {"tenant": handle.request.tenant, "adapter": adapter_label(handle.adapter)}
        if output.new_token_ids:
            previous = handle.last_token_time.get(output.index)
            if previous is None:
                if not handle.last_token_time:  # the request's first token (n completions share one prefill)
                    self.metrics.ttft_seconds.labels(**labels).observe(now - handle.arrival)
            else:
                gap = (now - previous) / len(output.new_token_ids)
                for _ in output.new_token_ids:
                    self.metrics.inter_token_seconds.labels(**labels).observe(gap)
            handle.last_token_time[output.index] = now
        self._send(handle, ("output", output))
        if output.finished:
            handle.finished[output.index] = output
        if len(handle.finished) == handle.num_completions:
            self._end(handle, now)

    def _end(self, handle: RequestHandle, now: float) -> None:
        del self.handles[handle.request_id]
        since = self._adapter_waits.pop(handle.request_id, None)
        if since is not None:  # it ended waiting: its adapter failed, or it was aborted
            self.metrics.adapter_wait_seconds.observe(handle.adapter_wait_s + now - since)
        for engine_id in handle.engine_request_ids:
            self.routes.pop(engine_id, None)
        outputs = [handle.finished[i] for i in sorted(handle.finished)]
        reasons = [o.finish_reason for o in outputs]
        reason = "error" if "error" in reasons else "abort" if handle.aborted else reasons[0]
        n = handle.request.sampling.n
        usage = sum_usage([merge_choices(outputs[at : at + n]).usage for at in range(0, len(outputs), n)])
        end = RequestEnd(finish_reason=reason, usage=usage, e2e_ms=(now - handle.arrival) * 1000.0, outputs=outputs)
        request = handle.request
        self.metrics.requests.labels(tenant=request.tenant, adapter=adapter_label(handle.adapter),
                                     finish_reason=reason).inc()
        self.metrics.e2e_seconds.labels(tenant=request.tenant).observe(end.e2e_ms / 1000.0)
        self.metrics.queue_seconds.labels(tenant=request.tenant).observe(usage.queue_ms / 1000.0)
        self.metrics.tokens.labels(kind="prompt").inc(usage.prompt_tokens)
        self.metrics.tokens.labels(kind="cached").inc(usage.cached_tokens)
        transfer = request.kv_transfer
        prefill_hop = transfer is not None and transfer.mode == "prefill"
        if prefill_hop and reason not in ("error", "abort"):  # before any other step can evict the prompt's blocks
            movable = self.engine.workers is None  # a tensor-parallel rank 0 holds a shard of the heads: nothing
            keys = self.engine.kv_keys(handle.prompts[0], adapter=handle.adapter, tenant=request.tenant) \
                if movable else []
            handle.lease = self.leases.grant(keys, ttl_s=transfer.lease_ttl_s, request_id=request.request_id)
        if self.emitter is not None and not prefill_hop:  # a prefill hop's usage is the gateway's to report
            self.emitter.emit(UsageEvent(
                request_id=request.request_id, tenant=request.tenant, api_key_id=request.api_key_id,
                adapter_digest=handle.adapter, base_model=self.base_model, prompt_tokens=usage.prompt_tokens,
                cached_tokens=usage.cached_tokens, completion_tokens=usage.completion_tokens,
                gpu_ms=usage.gpu_ms, queue_ms=usage.queue_ms, ttft_ms=usage.ttft_ms, e2e_ms=end.e2e_ms,
                finish_reason=reason, finished_at=now_utc(), metadata=request.metadata,
                spec_proposed_tokens=usage.spec_proposed_tokens, spec_accepted_tokens=usage.spec_accepted_tokens,
                sampling_steps=usage.sampling_steps, image_count=sum(map(len, handle.images)),
                image_tokens=sum(image.num_tokens for images in handle.images for image in images),
            ))
            self.metrics.usage_spooled.set(self.emitter.spooled)
        self._send(handle, ("end", end))

    def _send(self, handle: RequestHandle, item: tuple[str, Any]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(handle.events.put_nowait, item)

    def _observe_step(self, seconds: float, outputs: list[RequestOutput]) -> None:
        scheduler = self.engine.scheduler
        finished = sum(o.finished for o in outputs)
        adapters = sorted({adapter_label(s.adapter) for s in scheduler.running})
        tokens = sum(len(o.new_token_ids) for o in outputs)
        self.last_step = {"sequences": len(scheduler.running) + finished, "adapters": adapters,
                          "new_tokens": tokens, "ms": seconds * 1000.0}
        m = self.metrics
        m.step_seconds.observe(seconds)
        m.batch_size.observe(self.last_step["sequences"])
        m.batch_adapters.observe(len(adapters))
        m.tokens.labels(kind="completion").inc(tokens)
        now = time.monotonic()
        self._step_times.append((now, tokens))
        while self._step_times and self._step_times[0][0] < now - RATE_WINDOW_S:
            self._step_times.popleft()
        m.tokens_per_second.set(self.tokens_per_second())
        m.steps_per_second.set(self.steps_per_second())
        m.observe_state(self.engine.state())
        self._track_adapter_tiers()
        m.observe_adapter_loads(self.engine.adapter_pool)

    def steps_per_second(self) -> float:
        return len(self._step_times) / RATE_WINDOW_S

    def tokens_per_second(self) -> float:
        return sum(tokens for _, tokens in self._step_times) / RATE_WINDOW_S

    def _resident(self) -> dict[str, set[str]]:
        resident = self.engine.adapter_pool.resident()
        return {"gpu": set(resident["device"]), "host": set(resident["host"])}

    def _track_adapter_tiers(self) -> None:
        now = self._resident()
        for tier, digests in now.items():
            self.metrics.adapter_loads.labels(tier=tier).inc(len(digests - self._tiers[tier]))
            self.metrics.adapter_evictions.labels(tier=tier).inc(len(self._tiers[tier] - digests))
        self._tiers = now

    def state(self, *, model: str, prefixes: list[str]) -> EngineState:
        """Engine thread only (call it through `call`): what routing and the console read of this engine."""
        engine = self.engine
        state = engine.state()
        pool = state["adapters"]
        return EngineState(
            model=model, role=engine.config.role, accepting=self.accepting, capacity=engine.config.max_num_seqs,
            running=state["running"], waiting=state["waiting"], kv_blocks_used=state["kv_blocks_used"],
            kv_blocks_free=state["kv_blocks_free"], kv_blocks_total=state["kv_blocks_total"],
            kv_pool=PoolCounts(**pool_counts(engine.block_manager)),
            prefix_cache_hit_rate=state["prefix_cache_hit_rate"], busy_ms=state["busy_ms"], steps=state["steps"],
            preemptions=state["preemptions"], tokens_per_second=self.tokens_per_second(),
            memory=Memory(**state["memory"]),
            adapters=Adapters(
                gpu=pool["gpu"], host=pool["host"], loading=pool["loading"], placing=pool["placing"],
                in_use=pool["in_use"], pinned=pool["pinned"],
                residency=[AdapterResidency(**entry) for entry in pool["residency"]],
                load_seconds=LoadSeconds(**pool["load_seconds"]), failed=pool["failed"],
                registered=pool["registered"], host_bytes=pool["host_bytes"], device_pages=pool["device_pages"],
            ),
            prefixes=prefixes, request_seconds=state["request_seconds"], channel=CHANNEL_PATH,
        )  # fmt: skip

    def state_answer(self, *, model: str, prefixes: list[str], kv_pulls_in_flight: int) -> StateAnswer:
        """Engine thread only: GET /v1/state's answer, the state and the engine's insides."""
        scheduler, state = self.engine.scheduler, self.engine.state()
        running = [RequestOnEngine(s.request_id, s.index, s.tenant, s.adapter, s.num_completion_tokens)
                   for s in scheduler.running]
        waiting = [RequestOnEngine(s.request_id, s.index, s.tenant, s.adapter) for s in scheduler.waiting]
        return StateAnswer(
            **msgspec.structs.asdict(self.state(model=model, prefixes=prefixes)),
            running_requests=running, waiting_requests=waiting, steps_per_second=self.steps_per_second(),
            last_step=LastStep(**self.last_step), tensor_parallel_size=state["tensor_parallel_size"],
            block_size=state["block_size"], kv_pulls_in_flight=kv_pulls_in_flight, kv_tiers=state["kv_tiers"],
            kv_leases=self.leases.state(), speculation=state["speculation"], grammars=state["grammars"],
        )  # fmt: skip


def pool_counts(bm) -> dict:
    """The page pool's own counts: free + evictable + in_use + adapter_pages == total; `held` (blocks held outside
    any sequence: by leases, imports, transfers) is part of in_use. Engine thread only."""
    in_use = sum(1 for count in bm.ref_counts if count) - len(bm.adapter_pages)
    return {"total": bm.num_blocks, "free": len(bm.free_ids), "evictable": len(bm.evictable), "in_use": in_use,
            "held": len(bm.held), "adapter_pages": len(bm.adapter_pages)}
