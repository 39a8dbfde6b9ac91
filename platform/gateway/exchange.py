"""The state of one admitted request and its life with the engine: routing and opening the engine stream (retried once
on another engine, with a prefill hop where the fleet has one), reading its events into the response, and the
settle that replaces the hold by what was served.

The hold is settled by the relay (relay.py says where): `Exchange.settle` runs once, never cut short by the
cancellation that a client's disconnect delivers, after the engine stream is closed (closing it makes the engine
abort the request)."""

import asyncio
import logging
import time
from decimal import Decimal
from operator import attrgetter

from asgiref.sync import sync_to_async
from django.conf import settings

from engine.contract import (
    ADAPTER_UNAVAILABLE,
    PREFIX_CHUNK_CHARS,
    UsageEvent,
    UsageMetadata,
    billed_cached_tokens,
    now_utc,
    prompt_fingerprints,
)
from engine.contract.events import Delta as DeltaEvent
from engine.contract.events import Final, KVPull
from gateway import engine_client, metrics, request_reports
from gateway.admission import admission_settle, spend_to_micros, spend_to_picos
from gateway.caller import Caller
from gateway.connections import DATABASE_DOWN, STORE_DOWN, checked_connection
from gateway.disaggregation import (
    PrefillFailed,
    PrefillHop,
    decode_payload,
    end_lease,
    prefetch_soon,
    prefill_hop,
    prefill_payload,
    refuses_the_request,
)
from gateway.engine_client import (
    AdapterUnavailable,
    EngineBroke,
    EngineRef,
    EngineRejected,
    EngineUnavailable,
    GenerateStream,
)
from gateway.engine_events import delta_of, final_of
from gateway.engine_refusals import engine_refusal
from gateway.errors import adapter_unavailable, no_engine
from gateway.hot_settings import hot
from gateway.openai_request import GenerationRequest
from gateway.openai_response import Delta, ResponseBuilder, Usage
from gateway.routing import engines_refresh, router
from gateway.serving import Serving
from gateway.token_text import Vocabulary, vocabulary
from gateway.usage_report import usage_json, usage_send
from metering.pricing import request_price_picos
from metering.services import request_body_store

log = logging.getLogger(__name__)

ATTEMPTS = 2  # an engine that fails before the first event is retried once on another
_NO_VOCABULARY = Vocabulary(None)  # a request that shows no tokens: the same (stateless) one for all


def echoes(generation: GenerationRequest, vocabulary: Vocabulary) -> list[str]:
    """Each choice's echoed prompt (completions with `echo`, the only ones asked): a token prompt as its text."""
    texts = [p if isinstance(p, str) else vocabulary.decode(p) for p in generation.prompts]
    return [text for text in texts for _ in range(generation.n)]


class Exchange:
    """The state of one admitted request. What starts the same for every request starts as a class attribute."""

    first_token_at: float | None = None
    answer_status = 200  # what the client was answered, once an engine took the request
    engine: EngineRef | None = None
    stream: GenerateStream | None = None
    prefill: PrefillHop | None = None  # disaggregated: the prefill hop's lease and GPU time
    usage_reported = False
    broke = False
    error_type: str | None = None  # the engine's, when it failed the request
    hold_lease: object | None = None  # admitted from an admission lease: its ticket, for the settle
    _settled = False

    def __init__(
        self, *, request_id: str, serving: Serving, generation: GenerationRequest, max_tokens: int, choices: int,
        prompt_bytes: int, hold_tokens: int, hold_spend: Decimal, received: float,
    ):  # fmt: skip
        self.request_id = request_id
        self.hold_tokens = hold_tokens
        self.hold_spend = hold_spend
        self.serving = serving
        self.caller = serving.caller
        self.target = target = serving.target
        self.generation = generation
        self.max_tokens = max_tokens
        self.prompt_bytes = prompt_bytes  # generation.prompt_bytes(), as admission had it (and choices, num_choices)
        tokens_shown = generation.logprobs or (generation.echo and generation.prompt_token_count() > 0)
        self.vocabulary = vocabulary(target.checkpoint_dir) if tokens_shown else _NO_VOCABULARY
        self.builder = ResponseBuilder(
            kind=generation.kind, request_id=request_id, model=target.name, n=choices, logprobs=generation.logprobs,
            echo=echoes(generation, self.vocabulary) if generation.echo else [],
            continuous_usage=generation.continuous_usage,
        )  # fmt: skip
        self.started = received  # the gateway's receipt of the request: TTFT and latency count from here
        self.labels = serving.labels
        self.first: list[dict] = []  # the first events, read while a retry was still possible (applied first)

    def metadata(self, engine: EngineRef) -> dict:
        metadata = self.serving.metadata.copy()  # model, adapter_version_id
        metadata["engine"] = engine.name
        if self.prefill is not None and engine.name != self.prefill.engine.name:
            metadata["prefill"] = self.prefill.attribution()  # metering costs it at the prefill engine's price
        return metadata

    def payload(self, engine: EngineRef) -> dict:
        generation = self.generation
        payload = self.serving.payload.copy()  # tenant, weight, api_key_id, adapter, stream: the key's and model's
        payload["request_id"] = self.request_id
        payload["sampling"] = generation.sampling | {"max_tokens": self.max_tokens}
        if generation.max_tokens_given:
            payload["context_overflow"] = "refuse"
        if _metadata_accepted.get(engine.name, True):  # the engine's shared one found without a call, if made
            payload["metadata"] = self.metadata(engine) if self.prefill is not None else \
                self.serving.by_engine.get(engine.name) or self.serving.engine_metadata(engine.name)  # fmt: skip
        if generation.messages is not None:
            payload["messages"] = generation.messages
            payload |= generation.structure
        else:
            prompts = generation.prompts
            name = "prompt" if isinstance(prompts[0], str) else "prompt_token_ids"
            payload[name] = prompts[0] if len(prompts) == 1 else prompts
        if self.prefill is not None and engine.name != self.prefill.engine.name:
            payload = decode_payload(payload, self.prefill)
        return payload

    async def _try(self, engine: EngineRef) -> None:
        """Opens the stream on one engine and reads its first event; EngineUnavailable if that fails."""
        try:
            self.stream = await GenerateStream(engine, self.payload(engine)).open()
        except EngineRejected as rejected:
            if "'metadata'" not in rejected.message or not _metadata_accepted.get(engine.name, True):
                raise
            log.warning("engine %s does not accept request metadata; usage events will lack it", engine.name)
            _metadata_accepted[engine.name] = False
            self.stream = await GenerateStream(engine, self.payload(engine)).open()
        try:
            events = await self.stream.events()  # not None: the stream ends with its final event
        except EngineBroke as error:
            await self.stream.close()
            self.stream = None
            raise EngineUnavailable(f"{engine.name} failed before its first event: {error!r}") from error
        first = events[0]
        if first.__class__ is Final:
            self.stream.finished = True  # taken: an engine that finished at once is not aborted
            if first.error_type == ADAPTER_UNAVAILABLE:
                await self.stream.close()
                self.stream = None  # nothing was served: the engine's usage event (if any) settles nothing here
                raise AdapterUnavailable(f"{engine.name}: {first.error}")
        self.first = events

    async def open(self) -> None:
        """Routes and opens the engine stream, retrying once on another engine if one fails before answering."""
        if time.monotonic() >= router.stale_at:  # `engines_refresh()` only when it has something to do
            await engines_refresh()
        tried: set[str] = set()
        generation, digest = self.generation, self.target.digest
        first_prompt = generation.prompts[0] if generation.prompts else None  # a batch shares one engine
        fingerprints = [] if first_prompt.__class__ is str and len(first_prompt) < PREFIX_CHUNK_CHARS else \
            prompt_fingerprints(tenant=self.serving.tenant, adapter=digest, messages=generation.messages,
                                prompt=first_prompt if isinstance(first_prompt, str) else None)  # [] without a chunk
        one_prompt = generation.messages is not None or len(generation.prompts) == 1
        for attempt in range(ATTEMPTS):
            route = router.route(
                digest=digest, fingerprints=fingerprints, prompt_chars=self.prompt_bytes,
                prompt_tokens=0 if first_prompt.__class__ is str else generation.prompt_token_count(),
                exclude=frozenset(tried), min_uncached_tokens=hot.QUILT_PREFILL_HOP_MIN_UNCACHED_TOKENS,
                # a retry keeps the lease it has, if any; a prompt with images is served by one engine
                disaggregate=one_prompt and attempt == 0 and not generation.image_params,
            )  # fmt: skip
            if route is None:
                break
            engine = route.engine
            router.started(engine, digest, fingerprints)
            self.engine = engine
            if route.prefill is not None:
                try:
                    await self._prefill(route.prefill, engine, fingerprints)
                except EngineRejected as rejected:  # the request itself: the decode engine need not see it
                    metrics.disaggregation.labels("refused").inc()
                    raise engine_refusal(rejected, self.generation) from None
            elif route.reason in ("short", "no_prefill_engine"):
                metrics.disaggregation.labels(route.reason).inc()
            try:
                await (self._try(engine) if self.prefill is None else self._open_on(engine))
                return
            except EngineUnavailable as error:
                log.warning("engine %s unavailable for %s: %s", engine.name, self.request_id, error)
                router.ended(engine)
                router.suspect(engine.name)
                self.engine = None
                tried.add(engine.name)
            except AdapterUnavailable as error:  # this request's adapter only: the engine serves everyone else
                log.warning("adapter unavailable for %s: %s", self.request_id, error)
                router.ended(engine)
                self.engine = None
                raise adapter_unavailable(self.target.name) from None
            except EngineRejected as rejected:
                raise engine_refusal(rejected, self.generation) from None
        raise no_engine()

    async def _open_on(self, engine: EngineRef) -> None:
        """`_try`; a decode engine that refuses the prefill hop's lease (not the request) gets the request again
        without it: it computes the prompt itself."""
        try:
            await self._try(engine)
        except EngineRejected as rejected:
            if self.prefill is None or engine.name == self.prefill.engine.name or refuses_the_request(rejected):
                raise
            log.warning("decode engine %s refused the lease of %s (%s %s): it computes the prompt itself",
                        engine.name, self.request_id, rejected.status, rejected.message)  # fmt: skip
            metrics.prefill_fallbacks.labels("decode_refused").inc()
            end_lease(self.prefill, self.request_id)
            self.prefill = None
            await self._try(engine)

    async def _prefill(self, engine: EngineRef, decode: EngineRef, fingerprints: list[str]) -> None:
        """The prefill hop on `engine` for the request `decode` will serve; on failure the request goes on whole."""
        digest = self.target.digest
        router.started(engine, digest, fingerprints)
        if digest and digest not in decode.resident:
            prefetch_soon(decode, adapter=self.target.engine_adapter)
        try:
            payload = prefill_payload(self.payload(engine), lease_ttl_s=settings.QUILT_KV_LEASE_TTL_SECONDS)
            self.prefill = await prefill_hop(engine, payload, request_id=self.request_id,
                                             timeout_s=settings.QUILT_PREFILL_HOP_TIMEOUT_SECONDS)  # fmt: skip
            metrics.disaggregation.labels("disaggregated").inc()
        except PrefillFailed as failed:
            log.warning("prefill hop for %s failed (%s): %s; %s serves it whole", self.request_id, failed.reason,
                        failed, decode.name)  # fmt: skip
            metrics.disaggregation.labels("fallback").inc()
            metrics.prefill_fallbacks.labels(failed.reason).inc()
            if failed.reason in ("unavailable", "timeout"):
                router.suspect(engine.name)
        finally:
            router.ended(engine)

    def final(self, event: Final) -> list[tuple]:
        """Applies the final event to the response (a delta is the relay's to apply): each choice's finish and the
        usage; raises EngineBroke if the engine failed the request. Its choices' (index, finish reason)."""
        self.stream.finished = True
        final = final_of(event)
        builder = self.builder
        builder.finish(final.finishes)
        builder.usage = final.usage
        self.usage_reported = True
        if self.prefill is not None:
            self._count_transfer(final.kv_transfer)
            builder.usage.cached_tokens = billed_cached_tokens(decode_cached=builder.usage.cached_tokens,
                                                               prefill_cached=self.prefill.cached_tokens)  # fmt: skip
        if final.error is not None:
            self.error_type = final.error_type
            raise EngineBroke(final.error)
        return final.finishes

    def apply_delta(self, event: DeltaEvent) -> Delta:
        """A delta event the plain-text path does not take (log-probabilities, tool calls), applied to the response."""
        delta = delta_of(event, vocabulary=self.vocabulary)
        self.builder.apply(delta)
        if self.first_token_at is None and delta.tokens:
            self.first_token()
        return delta

    def first_token(self) -> None:
        """The response's first token has arrived: its time to first token."""
        self.first_token_at = time.monotonic()
        metrics.ttft.labels(*self.labels).observe(self.first_token_at - self.started)

    def _count_transfer(self, transfer: KVPull | None) -> None:
        recomputed = transfer is None or transfer.recomputed
        if recomputed:
            log.warning("decode engine %s recomputed %s instead of pulling its KV (lease %s)",
                        self.engine.name if self.engine else "?", self.request_id, self.prefill.lease.id)
        metrics.kv_transfers.labels("recomputed" if recomputed else "pulled").inc()
        if transfer is None or not transfer.blocks_pulled:  # nothing pulled (or the engine could not reach the source to
            end_lease(self.prefill, self.request_id)  # say so): the lease's blocks need not wait for its TTL

    settled = property(attrgetter("_settled"), doc="Whether `settle` ran (or runs now); read in C, on every request.")

    async def settle(self) -> None:
        """Closes the engine stream and replaces the hold by what was served. Runs once. While it runs, a client's
        disconnect does not cancel its task (`settling`): the relay awaits it without a shield's task of its own; and
        the tenant's next admission that its hold would refuse waits for it (`settles_of`)."""
        if self._settled:
            return
        self._settled = True
        task = asyncio.current_task()
        _settling.add(task)
        tenant_id = self.caller.tenant_id
        done = task.get_loop().create_future()
        pending = _tenant_settles.get(tenant_id)
        if pending is None:
            pending = _tenant_settles[tenant_id] = set()
        pending.add(done)
        try:
            await self._settle()
        finally:
            _settling.discard(task)
            pending.discard(done)
            if not pending and _tenant_settles.get(tenant_id) is pending:
                del _tenant_settles[tenant_id]
            done.set_result(None)

    async def _settle(self) -> None:
        stream, engine = self.stream, self.engine
        if stream is not None:  # an engine took it: its event has the row, the gateway adds its times
            request_reports.answered(request_id=self.request_id, status_code=self.answer_status,
                                     received=self.started, first_token=self.first_token_at)  # fmt: skip
            finished = stream.finished
            stream.end()
            if not finished and not self.broke and engine is not None:
                await engine_client.abort(engine, self.request_id)
        if engine is not None:
            router.ended(engine)
        usage, caller, reported = self.builder.usage, self.caller, self.usage_reported
        if not reported:
            usage.completion_tokens = sum(choice.tokens for choice in self.builder.choices)
            if self.broke and engine is not None:
                await self._report_lost_usage(engine)
        final, served, now = False, "", time.monotonic()  # final: metering's settle, once it has the engine's event
        if reported:  # the engine's counts
            tokens = usage.prompt_tokens + usage.completion_tokens
            picos = request_price_picos(rates=self.serving.rates, prompt_tokens=usage.prompt_tokens,
                                        cached_tokens=usage.cached_tokens, completion_tokens=usage.completion_tokens)
            micros = -(-picos // 1_000_000)  # spend_to_micros of the same price: rounded up
            served = self._served_event(now, usage, caller)
        elif stream is not None:  # an engine took it, then the stream broke or the client left: keep the hold
            tokens, micros, picos = self.hold_tokens, spend_to_micros(self.hold_spend), spend_to_picos(self.hold_spend)
        else:  # no engine took it (none left, refused, adapter unavailable): nothing to wait for
            tokens, micros, picos, final = 0, 0, 0, True
        if caller.body_retention_days and stream is not None:
            await self._keep_bodies()
            now = time.monotonic()
        outcome = "ok" if reported and not self.broke else "broken" if self.broke else "unserved" if final else "abandoned"
        metrics.request_ended(self.labels, outcome, now - self.started, usage.prompt_tokens, usage.cached_tokens,
                              usage.completion_tokens, counted=reported)  # fmt: skip
        try:
            await admission_settle(tenant_id=caller.tenant_id, request_id=self.request_id, tokens=tokens,
                                   spend_micros=micros, key_spend_picos=picos, final=final,
                                   key_prefix=caller.limits.key_prefix, usage=served, lease=self.hold_lease)  # fmt: skip
        except STORE_DOWN as error:  # what was served (or refused) is answered as it was, whatever the store says
            metrics.settle_failures.labels(str(caller.tenant_id)).inc()
            log.warning("could not settle the hold of %s (%r); its answer ends as served. Metering's settle of the "
                        "engine's usage event releases the hold, else its TTL does", self.request_id, error)  # fmt: skip

    def _served_event(self, now: float, usage: Usage, caller: Caller) -> str:
        """The usage event the client was served (JSON), kept with the provisional settle until metering records the
        request, billed if the engine's own never comes (an engine killed, its spool lost with its pod)."""
        first, started = self.first_token_at, self.started
        reason = "length" if "length" in map(_FINISH_REASON, self.builder.choices) else "stop"
        return usage_json(self._usage_event(
            usage, finish_reason=reason, e2e_ms=(now - started) * 1000.0,
            ttft_ms=(first - started) * 1000.0 if first is not None else None))  # fmt: skip

    def _usage_event(self, usage: Usage, *, finish_reason: str, e2e_ms: float, ttft_ms: float | None,
                     error: str = "") -> UsageEvent:  # fmt: skip
        """The gateway's own usage event for this request, as the engine would have sent it (no GPU or queue time)."""
        caller, target, engine, prefill = self.caller, self.target, self.engine, self.prefill
        share = None
        if prefill is not None and engine is not None and engine.name != prefill.engine.name:
            share = prefill.attribution()
        return UsageEvent(
            request_id=self.request_id, tenant=self.serving.tenant, api_key_id=str(caller.key_id),
            adapter_digest=target.digest, base_model=target.base_model, prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens, completion_tokens=usage.completion_tokens, ttft_ms=ttft_ms,
            e2e_ms=e2e_ms, finish_reason=finish_reason, finished_at=now_utc(), error=error,
            metadata=UsageMetadata(model=target.name, adapter_version_id=target.adapter_version_id,
                                   engine=engine.name if engine is not None else "", prefill=share),
        )  # fmt: skip

    async def _keep_bodies(self) -> None:
        """The tenant opted in: its prompt and completion go to the request log, for its retention period."""
        generation = self.generation
        prompt = generation.messages if generation.messages is not None else generation.prompts
        completion = "\n\n".join(choice.text for choice in self.builder.choices)
        try:
            await _store_bodies(
                tenant_id=self.caller.tenant_id, request_id=self.request_id, prompt=prompt, completion=completion,
                retention_days=self.caller.body_retention_days,
            )  # fmt: skip
        except DATABASE_DOWN:  # the answer is served; only the log's copy of its text is lost
            log.exception("could not keep the bodies of %s", self.request_id)

    async def _report_lost_usage(self, engine: EngineRef) -> None:
        usage = self.builder.usage
        event = self._usage_event(
            Usage(usage.prompt_tokens, 0, usage.completion_tokens), finish_reason="error", ttft_ms=None,
            e2e_ms=(time.monotonic() - self.started) * 1000.0, error="The engine stopped answering mid-request.",
        )  # fmt: skip
        try:
            await sync_to_async(usage_send, thread_sensitive=False)(event)
        except Exception:  # the broker is down too: the hold is still settled below
            log.exception("could not send the usage event of %s", self.request_id)


_metadata_accepted: dict[str, bool] = {}
_FINISH_REASON = attrgetter("finish_reason")
_settling: set[asyncio.Task] = set()  # the tasks running a settle now
_tenant_settles: dict[int, set[asyncio.Future]] = {}  # tenant id -> its settles running now, each done when it ends


def settling(task: asyncio.Task) -> bool:
    """Whether `task` is settling a hold now: a client's disconnect then lets it finish instead of cancelling it."""
    return task in _settling


async def settles_of(tenant_id: int) -> bool:
    """Waits for the settles of `tenant_id`'s requests that run in this process now (their streams' ends have left:
    the client may already be asking again); whether there were any."""
    pending = _tenant_settles.get(tenant_id)
    if not pending:
        return False
    await asyncio.wait(list(pending))
    return True
_store_bodies = sync_to_async(checked_connection(request_body_store), thread_sensitive=False)
