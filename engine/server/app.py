"""The engine's internal HTTP API (Starlette): generate (and its channel), abort, tokenize, adapters, health, state,
metrics."""

import asyncio
import contextlib
import dataclasses
import logging
import time

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute

from engine.adapter_pool import PinRefused
from engine.chat_prompt import PromptImageError, render_chat
from engine.contract import ADAPTER_UNAVAILABLE, CONTEXT_LENGTH_EXCEEDED
from engine.contract.channel import CHANNEL_PATH
from engine.contract.kv import PrefillAnswer, PrefillUsage
from engine.grammar import Grammar, GrammarError
from engine.images import ImageFeatures
from engine.sampling_params import SamplingParams
from engine.server.adapter_registry import AdapterRegistry, AdapterUnavailable, NotFound
from engine.server.auth import BearerAuth
from engine.server.channel import GenerateChannel
from engine.server.engine_loop import Conflict, EngineLoop, RequestEnd, RequestHandle, Unavailable
from engine.server.event_stream import EventStream, ndjson_events
from engine.server.events import final_event
from engine.server.kv_transfer import KVTransfers, PendingPull, PullReport
from engine.server.membership import Membership, RecentPrefixes
from engine.server.protocol import (
    DIGEST,
    BadRequest,
    PromptSpec,
    json_strict,
    parse_adapter,
    parse_generate,
    parse_tokenize,
)
from engine.server.structured import Structure, plan
from engine.tool_calls import format_for_template

log = logging.getLogger(__name__)



async def _adapter_and_tier(request: Request):
    """A prefetch or pin body: the adapter (its digest, and a path or signed URLs) and the tier, "host" by default."""
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    tier = body.pop("tier", "host")
    if not isinstance(tier, str):
        raise BadRequest("tier must be a string", param="tier")
    ref = parse_adapter(body)
    if ref is None:
        raise BadRequest("give the adapter's digest", param="digest")
    return ref, tier

class EngineAPI:
    def __init__(self, loop: EngineLoop, *, registry: AdapterRegistry, model_name: str,
                 drain_timeout_s: float, prefixes: RecentPrefixes | None = None, kv: KVTransfers | None = None) -> None:
        self.loop = loop
        self.kv = kv  # KV moved between engines (disaggregated serving); None: kv_transfer is refused
        self.prefixes = prefixes or RecentPrefixes()
        self.membership: Membership | None = None  # set when the engine joins a control plane (started by Draining)
        self.registry = registry
        self.model_name = model_name
        self.drain_timeout_s = drain_timeout_s
        self.engine = loop.engine
        self.channel = GenerateChannel(self, refusal=refusal_response)  # its streamed generates over a websocket
        tokenizer = self.engine.tokenizer
        self.tool_format = format_for_template(tokenizer.chat_template if tokenizer else None)  # once per model

    # helpers
    async def tokenize(self, prompt: PromptSpec, *, tools: list[dict] | None = None) -> list[int]:
        return (await self.render(prompt, tools=tools))[0]

    async def render(self, prompt: PromptSpec, *, tools: list[dict] | None = None
                     ) -> tuple[list[int], list[ImageFeatures]]:
        """A prompt's token ids and its images (chat messages' image_url parts, rendered as the offline LLM API
        renders them: engine.chat_prompt)."""
        tokenizer = self.engine.tokenizer
        vocab = self.engine.runner.model.spec.vocab_size
        if prompt.token_ids is not None:
            if any(t >= vocab for t in prompt.token_ids):
                raise BadRequest(f"prompt_token_ids must be below the vocabulary size {vocab}",
                                 param="prompt_token_ids")
            return list(prompt.token_ids), []
        if tokenizer is None:
            raise BadRequest("this model has no tokenizer.json: send prompt_token_ids", param="prompt")
        if prompt.messages is not None:
            vision = self.engine.image_inputs
            try:  # images are decoded and resized off the event loop
                return await asyncio.to_thread(render_chat, tokenizer, prompt.messages, vision=vision, tools=tools)
            except PromptImageError as error:
                raise BadRequest(str(error), param=error.param, code="invalid_image") from None
            except Exception as error:  # jinja2 errors, raise_exception() in templates, missing template
                raise BadRequest(f"could not apply the chat template: {error}", param="messages") from error
        return await asyncio.to_thread(tokenizer.encode, prompt.text), []

    def check_length(self, token_ids: list[int], *, max_tokens: int | None = None, what: str = "prompt") -> None:
        """A prompt must leave room for one more token; with `max_tokens` (the caller asked for a refusal past the
        context, as OpenAI refuses), for that many."""
        limit = self.engine.max_model_len
        if len(token_ids) >= limit:
            raise BadRequest(f"the prompt has {len(token_ids)} tokens; this model's context is {limit} tokens "
                             f"and the prompt must leave room for at least one more", param="prompt",
                             code=CONTEXT_LENGTH_EXCEEDED)
        if max_tokens is not None and len(token_ids) + max_tokens > limit:
            raise BadRequest(f"This model's maximum context length is {limit} tokens. However, you requested "
                             f"{len(token_ids) + max_tokens} tokens ({len(token_ids)} in the {what}, {max_tokens} in "
                             f"the completion). Please reduce the length of the {what} or completion.",
                             param="prompt", code=CONTEXT_LENGTH_EXCEEDED)

    def structure(self, generate) -> Structure:
        vocab = self.engine.runner.model.spec.vocab_size
        bias = generate.sampling.logit_bias or {}
        if any(token >= vocab for token in bias):
            raise BadRequest(f"sampling.logit_bias names token {max(bias)}; this model's token ids are below {vocab}",
                             param="sampling.logit_bias")
        past = [token for token in generate.sampling.stop_token_ids if token >= vocab]
        if past:
            raise BadRequest(f"sampling.stop_token_ids names token {max(past)}; this model's token ids are below {vocab}",
                             param="sampling.stop_token_ids")
        tokenizer = self.engine.tokenizer
        special_id = tokenizer.special_token_id if tokenizer else (lambda text: None)
        structure = plan(generate, tool_format=self.tool_format, special_id=special_id)
        if structure.grammars and self.engine.grammars is None:
            raise BadRequest("this model has no tokenizer.json: its output cannot be constrained",
                             param=structure.grammar.param)
        return structure

    async def compile(self, structure: Structure) -> Grammar | None:
        """The request's grammar, compiled (or found in the cache) in a thread before it joins any batch: its
        compile time is part of no step and of no other request's GPU time."""
        grammar = None
        for spec in structure.grammars:
            try:
                grammar = await asyncio.to_thread(self.engine.grammars.compile, spec)
            except GrammarError as error:
                raise BadRequest(str(error), param=error.param) from error
        return grammar

    # routes
    async def prepared(self, generate) -> tuple[Structure, list[list[int]], list[list[ImageFeatures]],
                                                Grammar | None, float]:
        """A generate's checks and what its submission needs: its structure, each prompt's tokens and images (their
        lengths checked), its grammar compiled and its adapter loaded (the seconds that took)."""
        structure = self.structure(generate)
        max_tokens = generate.sampling.max_tokens if generate.context_overflow == "refuse" else None
        rendered = [await self.render(prompt, tools=structure.template_tools) for prompt in generate.prompts]
        prompts, images = [token_ids for token_ids, _ in rendered], [found for _, found in rendered]
        for prompt, token_ids in zip(generate.prompts, prompts, strict=True):
            self.check_length(token_ids, max_tokens=max_tokens,
                              what="messages" if prompt.messages is not None else "prompt")
        grammar = await self.compile(structure)
        transfer = generate.kv_transfer
        if transfer is not None and self.kv is None:
            raise BadRequest("this engine does not move KV between engines", param="kv_transfer")
        if transfer is not None and any(images):
            raise BadRequest("a prompt with images is served by one engine: drop kv_transfer", param="kv_transfer")
        waited = await self.registry.ensure(generate.adapter) if generate.adapter is not None else 0.0
        return structure, prompts, images, grammar, waited

    async def started(self, generate, arrival: float) -> tuple[RequestHandle, tuple]:
        """A streamed generate without kv_transfer, submitted: its handle and its first queue item (until something is
        sent, the answer's status can still be chosen)."""
        structure, prompts, images, grammar, waited = await self.prepared(generate)
        handle = await self.loop.submit(generate, prompts, arrival=arrival, grammar=grammar,
                                        tool_format=structure.tool_format, adapter_wait_s=waited, images=images)
        self.prefixes.record(generate)
        return handle, await handle.events.get()

    def unreadable_adapter(self, generate, first: tuple) -> JSONResponse | None:
        """The answer to a streamed request whose first queue item ends it because its adapter could not be read
        (the adapter marked unreadable), None for any other."""
        if first[0] == "end" and adapter_unavailable(first[1]):
            self.registry.unreadable(generate.adapter)
            return unavailable_response(first[1])
        return None

    # routes
    async def generate(self, request: Request) -> Response:
        arrival = time.monotonic()
        generate = parse_generate(await request.body())
        transfer = generate.kv_transfer
        if transfer is None and generate.stream:
            handle, first = await self.started(generate, arrival)
            refused = self.unreadable_adapter(generate, first)
            if refused is not None:
                return refused
            return EventStream(ndjson_events(handle, first, self.loop.abort_soon), media_type="application/x-ndjson")
        structure, prompts, images, grammar, waited = await self.prepared(generate)
        if transfer is not None and transfer.mode == "prefill":
            return await self.prefill_hop(request, generate, prompts[0], arrival, adapter_wait_s=waited)
        if transfer is None:
            handle = await self.loop.submit(generate, prompts, arrival=arrival, grammar=grammar,
                                            tool_format=structure.tool_format, adapter_wait_s=waited, images=images)
        else:
            handle = await self.decode_hop(request, generate, prompts, arrival=arrival, grammar=grammar,
                                           structure=structure, adapter_wait_s=waited)
            if handle is None:
                return Response(status_code=499)  # the client went away during the pull
        self.prefixes.record(generate)
        if generate.stream:
            first = await handle.events.get()  # until something is sent, the status can still be chosen
            refused = self.unreadable_adapter(generate, first)
            if refused is not None:
                return refused
            return EventStream(ndjson_events(handle, first, self.loop.abort_soon), media_type="application/x-ndjson")
        end = await self.wait(request, handle)
        if end is None:
            return Response(status_code=499)
        if adapter_unavailable(end):
            self.registry.unreadable(generate.adapter)
            return unavailable_response(end)
        return Response(msgspec.json.encode(final_event(handle, end)), media_type="application/json")

    async def prefill_hop(self, request: Request, generate, prompt: list[int], arrival: float, *,
                          adapter_wait_s: float) -> Response:
        """kv_transfer mode "prefill": compute the prompt's KV (one greedy token is sampled and dropped), lease its
        full blocks and answer the lease; the decode hop serves the request. No usage event: the gateway reports
        this hop's GPU time from the answer's usage."""
        hop = dataclasses.replace(generate, sampling=SamplingParams(max_tokens=1, temperature=0.0),
                                  response_format=None, tools=None, tool_choice=None)
        handle = await self.loop.submit(hop, [prompt], arrival=arrival, adapter_wait_s=adapter_wait_s)
        self.prefixes.record(generate)  # its blocks stay in this engine's prefix cache once the lease ends
        end = await self.wait(request, handle)
        if end is None or handle.lease is None:
            if end is None and handle.lease is not None:  # it ended as the client went: nobody will pull
                await self.loop.call(lambda engine: self.loop.leases.release(handle.lease.id, "released"))
            if end is not None and adapter_unavailable(end):
                self.registry.unreadable(generate.adapter)
                return unavailable_response(end)
            if end is not None and end.finish_reason == "error":
                message = next((o.error for o in end.outputs if o.error), "the prefill failed")
                return error_response(503, "unavailable_error", f"prefill failed: {message}")
            return Response(status_code=499)  # aborted
        ttl = generate.kv_transfer.lease_ttl_s
        usage = PrefillUsage(prompt_tokens=end.usage.prompt_tokens, cached_tokens=end.usage.cached_tokens,
                             gpu_seconds=end.usage.gpu_ms / 1000.0)  # fmt: skip
        answer = PrefillAnswer(kv_lease=self.kv.lease(handle.lease, ttl), usage=usage)
        return Response(msgspec.json.encode(answer), media_type="application/json")

    async def decode_hop(self, request: Request, generate, prompts: list[list[int]], *, arrival: float,
                         grammar: Grammar | None, structure: Structure, adapter_wait_s: float) -> RequestHandle | None:
        """kv_transfer mode "decode": pull the prompt's blocks under the lease (recomputing what cannot be had),
        then submit the request as usual; None when the client went away during the pull."""
        if not self.loop.accepting:  # before the pull: the lease stays whole for the engine a retry finds
            raise Unavailable("the engine is shutting down")
        if generate.request_id in self.kv.pending:
            raise Conflict(f"request {generate.request_id!r} is already running")
        try:
            report = await self.pull(request, generate, prompts[0])
            if report is None:
                return None
            pending = self.kv.pending[generate.request_id]
            handle = await self.loop.submit(generate, prompts, arrival=arrival, grammar=grammar,
                                            tool_format=structure.tool_format, kv_pull=report,
                                            aborted=pending.aborted, adapter_wait_s=adapter_wait_s)  # (aborted during the pull: it ends now)
        finally:
            pending = self.kv.pending.pop(generate.request_id)
        if pending.aborted and not handle.aborted:  # aborted as it was being submitted
            await self.loop.abort(generate.request_id)
        return handle

    async def pull(self, request: Request, generate, prompt: list[int]) -> PullReport | None:
        """A decode hop's pull, raced against the client going away (then None: the pull stops, which releases the
        lease) and open to POST /v1/abort (then the request is submitted, and aborted at once)."""
        task = asyncio.create_task(self.kv.pull(generate, prompt))
        pending = self.kv.pending[generate.request_id] = PendingPull(task)
        disconnected = asyncio.create_task(wait_for_disconnect(request))
        try:
            await asyncio.wait({task, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnected.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if not pending.aborted:
            return None
        return PullReport(lease_id=generate.kv_transfer.lease.id, recomputed=True, reason="aborted")

    async def wait(self, request: Request, handle: RequestHandle) -> RequestEnd | None:
        """The request's end, or None if the client disconnected first (then it is aborted)."""
        disconnected = asyncio.create_task(wait_for_disconnect(request))
        try:
            while True:
                item = asyncio.create_task(handle.events.get())
                await asyncio.wait({item, disconnected}, return_when=asyncio.FIRST_COMPLETED)
                if not item.done():
                    item.cancel()
                    self.loop.abort_soon(handle.request_id)
                    return None
                kind, value = item.result()
                if kind == "end":
                    return value
        finally:
            disconnected.cancel()

    async def abort(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        if self.kv is not None and self.kv.abort(request_id):  # during its KV pull
            return JSONResponse({"request_id": request_id, "aborted": True})
        if not await self.loop.abort(request_id):
            raise NotFound(f"no running request {request_id!r}")
        return JSONResponse({"request_id": request_id, "aborted": True})

    async def tokenize_route(self, request: Request) -> Response:
        token_ids = await self.tokenize(parse_tokenize(await read_json(request)))
        return JSONResponse({"count": len(token_ids), "token_ids": token_ids,
                             "max_model_len": self.engine.max_model_len})

    async def prefetch(self, request: Request) -> Response:
        ref, tier = await _adapter_and_tier(request)
        tiers = await self.registry.prefetch(ref, tier=tier)
        return JSONResponse({"digest": ref.digest, "resident": tiers})

    async def pin(self, request: Request) -> Response:
        ref, tier = await _adapter_and_tier(request)
        tiers = await self.registry.pin(ref, tier=tier)
        return JSONResponse({"digest": ref.digest, "pinned": tier, "resident": tiers})

    async def unpin(self, request: Request) -> Response:
        body = await read_json(request)
        digest = body.get("digest") if isinstance(body, dict) else None
        if not isinstance(digest, str) or not DIGEST.match(digest):
            raise BadRequest("the digest must be 64 lowercase hex characters", param="digest")
        return JSONResponse({"digest": digest, "unpinned": await self.registry.unpin(digest)})

    async def evict(self, request: Request) -> Response:
        digest = request.path_params["digest"]
        if not DIGEST.match(digest):
            raise BadRequest("the digest must be 64 lowercase hex characters", param="digest")
        evicted = await self.registry.evict(digest)
        return JSONResponse({"digest": digest, "evicted": evicted})

    async def health(self, request: Request) -> Response:
        healthy = self.loop.healthy and self.engine.failure() is None  # a dead tensor-parallel rank shows at once
        status = "ok" if healthy and self.loop.accepting else "draining" if healthy else "unhealthy"
        body = {"status": status, "model": self.model_name, "device": str(self.engine.device),
                "max_model_len": self.engine.max_model_len}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def state(self, request: Request) -> Response:
        pulls = len(self.kv.pending) if self.kv is not None else 0  # decode hops pulling their KV now
        prefixes = self.prefixes.recent()  # read here: the event loop records them
        answer = await self.loop.call(lambda engine: self.loop.state_answer(
            model=self.model_name, prefixes=prefixes, kv_pulls_in_flight=pulls))
        return Response(msgspec.json.encode(answer), media_type="application/json")

    async def metrics(self, request: Request) -> Response:
        def observe(engine) -> None:
            self.loop.metrics.observe_state(engine.state())
            self.loop.metrics.observe_adapters(engine.adapter_pool)
            self.loop.metrics.observe_leases(self.loop.leases.state())

        await self.loop.call(observe)
        fetcher = self.registry.fetcher
        if fetcher is not None:
            self.loop.metrics.observe_downloads(fetcher.downloads, disk_cache_bytes=fetcher.cache.used_bytes)
        return Response(self.loop.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette):
        self.loop.start(asyncio.get_running_loop())
        if self.kv is not None:
            await self.kv.start()
        yield
        if self.kv is not None:
            await self.kv.close()  # drain: leases released, pulls refused
        if self.registry.fetcher is not None:
            await self.registry.fetcher.close()
        await asyncio.to_thread(self.loop.shutdown, drain_timeout_s=self.drain_timeout_s)


def build_app(api: EngineAPI, *, token: str) -> Starlette:
    routes = [
        Route("/v1/generate", api.generate, methods=["POST"]),
        Route("/v1/abort/{request_id}", api.abort, methods=["POST"]),
        Route("/v1/tokenize", api.tokenize_route, methods=["POST"]),
        Route("/v1/adapters/prefetch", api.prefetch, methods=["POST"]),
        Route("/v1/adapters/pin", api.pin, methods=["POST"]),
        Route("/v1/adapters/unpin", api.unpin, methods=["POST"]),
        Route("/v1/adapters/{digest}", api.evict, methods=["DELETE"]),
        Route("/v1/health", api.health, methods=["GET"]),
        Route("/v1/state", api.state, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        WebSocketRoute(CHANNEL_PATH, api.channel.session),
    ]
    handlers = {kind: refused_response for kind in REFUSALS} | {
        HTTPException: http_error_response,  # Starlette's own: no such route (404), wrong method (405)
    }
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=api.lifespan)
    app.add_middleware(BearerAuth, token=token)
    return app


# The errors a request can cause, and the answer each gets (on HTTP, and on the generate channel).
REFUSALS = {
    BadRequest: lambda e: error_response(400, "invalid_request_error", str(e), e.param, e.code),
    NotFound: lambda e: error_response(404, "not_found_error", str(e)),
    Conflict: lambda e: error_response(409, "conflict_error", str(e)),
    PinRefused: lambda e: error_response(409, "conflict_error", str(e), "tier", "pin_refused"),
    Unavailable: lambda e: error_response(503, "unavailable_error", str(e)),
    AdapterUnavailable: lambda e: error_response(503, ADAPTER_UNAVAILABLE, str(e), "adapter"),
}


def refusal_response(error: Exception) -> JSONResponse | None:
    """The answer to an error a request can cause (REFUSALS: its most derived kind's), None for any other."""
    answer = next((REFUSALS[kind] for kind in type(error).__mro__ if kind in REFUSALS), None)
    return None if answer is None else answer(error)


def refused_response(request: Request, error: Exception) -> JSONResponse:
    return refusal_response(error)


def adapter_unavailable(end: RequestEnd) -> bool:
    return any(output.error_type == ADAPTER_UNAVAILABLE for output in end.outputs)


def unavailable_response(end: RequestEnd) -> JSONResponse:
    message = next(o.error for o in end.outputs if o.error_type == ADAPTER_UNAVAILABLE)
    return error_response(503, ADAPTER_UNAVAILABLE, message, "adapter")


def http_error_response(request: Request, error: HTTPException) -> JSONResponse:
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {error.detail}"
    response = error_response(error.status_code, kind, message)
    response.headers.update(error.headers or {})
    return response


def error_response(status: int, kind: str, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    error = {"type": kind, "message": message, "param": param} | ({"code": code} if code else {})
    return JSONResponse({"error": error}, status_code=status)


async def read_json(request: Request):
    return json_strict(await request.body())


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
