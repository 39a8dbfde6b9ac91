"""The online engine: requests in, one scheduled step at a time, token deltas and usage out.

Built from engine/rank_model.py (rank 0's model stack, as every tensor-parallel worker builds its own),
engine/page_budget.py (the pool's size) and engine/output_processor.py (what a client sees of a sequence)."""

import dataclasses
import itertools
import time
from pathlib import Path

import torch

from adapters.file_reads import ReadPolicy
from engine.adapter_plan import AdapterPlan
from engine.adapter_pool import AdapterPool, PinRefused, read_adapter
from engine.block_keys import base_digest, model_digest
from engine.block_manager import BlockManager
from engine.chat_prompt import ImageInputs
from engine.config import EngineConfig
from engine.contract import ADAPTER_UNAVAILABLE
from engine.fairness import FirstComeFirstServed, VirtualTokenCounter
from engine.grammar import Grammar, GrammarCompiler
from engine.guided import GuidedDecoding
from engine.images import ImageFeatures, checkpoint_image_processor, place_images
from engine.kv import payload
from engine.kv.host_tier import HostTier
from engine.kv.lease import LeaseTable
from engine.kv.payload import KVBlock
from engine.model_runner import ModelRunner, StepResult
from engine.models import ModelSpec, read_hf_config, read_spec
from engine.output_processor import OutputProcessor
from engine.outputs import Logprob, RequestOutput
from engine.page_budget import PageShape, count_adapter_pages, count_pages, freed_window, page_shape
from engine.paged_memory import PagedMemory
from engine.parallel.communicator import Communicator
from engine.parallel.sharding import check_tensor_parallel, shard_adapter
from engine.quantization import checkpoint_quantization
from engine.quantization.memory import MemoryReport, kv_dtype
from engine.quantization.on_load import tensor_bytes, unquantized_bytes
from engine.rank_model import attach_pages, load_rank_model
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.speculative.build import build_speculator
from engine.tokenizer import Tokenizer, eos_token_ids
from engine.workers.worker_group import WorkerGroup

REQUEST_MEAN_WEIGHT = 0.1  # each finished sequence's share of the running mean of the time it held a slot


class LLMEngine:
    def __init__(self, config: EngineConfig, *, policy: FirstComeFirstServed | VirtualTokenCounter | None = None,
                 time_collectives: bool = False):
        model_dir, tp, model_dtype = Path(config.model), config.tensor_parallel_size, getattr(torch, config.dtype)
        self.device = torch.device(config.device)
        self.hf_config = read_hf_config(model_dir)
        spec = read_spec(self.hf_config)
        self.quant_spec = checkpoint_quantization(self.hf_config, quantization=config.quantization)  # refused here
        check_tensor_parallel(spec, size=tp, device=self.device)
        self.kv_dtype = kv_dtype(config.kv_cache_dtype, model_dtype, self.device)
        self.max_model_len = context_length(config, spec)
        self.tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").exists() else None
        # a vision-language model's images are preprocessed as its own processor does (engine/images.py)
        self.image_processor = checkpoint_image_processor(model_dir) if spec.vision is not None else None
        self.eos_token_ids = eos_token_ids(model_dir, self.hf_config, self.tokenizer)
        page = page_shape(config, spec, self.hf_config, dtype=model_dtype, kv_dtype=self.kv_dtype)
        self.config = config = dataclasses.replace(config, block_size=page.block_size)
        self.comm = Communicator(rank=0, size=tp, timed=time_collectives)
        self.workers = spawn_workers(config, timed=time_collectives)  # they load their shards meanwhile
        model = load_rank_model(model_dir, dtype=model_dtype, device=self.device, comm=self.comm,
                                quantization=config.quantization)
        workers_free = self.workers.connect(self.comm) if self.workers else []  # bytes free on each worker's device
        num_pages = count_pages(config, spec, device=self.device, model_dtype=model_dtype, kv_dtype=self.kv_dtype,
                                widths=page.widths, chunk=page.chunk, max_model_len=self.max_model_len,
                                tensor_parallel_size=tp, workers_free=workers_free)
        self.memory = attach_pages(model, num_pages=num_pages, block_size=config.block_size,
                                   kv_cache_dtype=config.kv_cache_dtype, device=self.device)
        self.model_digest = model_digest(model_dir)
        self.base_digest = base_digest(self.model_digest, dtype=config.dtype, quantization=config.quantization,
                                       kv_cache_dtype=config.kv_cache_dtype, tensor_parallel_size=tp)
        self.block_manager = BlockManager(num_blocks=num_pages, block_size=config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching,
                                          window=freed_window(config, spec), base=self.base_digest)
        self.host_tier = build_host_tier(config, self.block_manager, self.memory)
        self.max_model_len = self.block_manager.longest_fitting(self.max_model_len, config.max_num_batched_tokens)
        self.adapter_pool = build_adapter_pool(config, self.hf_config, spec, page, memory=self.memory,
                                               block_manager=self.block_manager, workers=self.workers,
                                               pin=self.device.type == "cuda")
        if self.workers:
            self.workers.start(model, num_pages)
        self.grammars = GrammarCompiler(model_dir / "tokenizer.json", vocab_size=model.spec.vocab_size,
                                        eos_token_ids=self.eos_token_ids) if self.tokenizer is not None else None
        self.guided = GuidedDecoding(vocab_size=model.spec.vocab_size, device=self.device)
        self.runner = ModelRunner(model=model, memory=self.memory, adapters=self.adapter_pool,
                                  eos_token_ids=self.eos_token_ids, device=self.device, guided=self.guided,
                                  cuda_graphs=config.cuda_graphs and self.device.type == "cuda",
                                  max_batch=config.max_num_seqs, max_model_len=self.max_model_len,
                                  max_adapter_rank=config.max_adapter_rank, max_tokens=config.max_num_batched_tokens)
        self.speculator = build_speculator(config, runner=self.runner, num_pages=num_pages,
                                           max_model_len=self.max_model_len)
        self.leases = LeaseTable(self.block_manager)  # KV blocks kept for other engines (docs/kv-tiers.md)
        self.scheduler = Scheduler(
            block_manager=self.block_manager,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            policy=policy,
            adapters=self.adapter_pool,
            lookahead=self.speculator.lookahead if self.speculator else None,
            connector=self.host_tier,
            leases=self.leases,
        )
        self.output_processor = OutputProcessor(tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids,
                                                max_model_len=self.max_model_len)
        self.requests: dict[str, list[Sequence]] = {}
        self.busy_ms = 0.0
        self.request_seconds: float | None = None  # running mean of first step -> finish (routing's queue wait)
        self.num_steps = 0
        self.num_preemptions = 0
        self.last_step_seqs = 0  # sequences in the last step that ran
        self.num_generated_tokens = 0  # tokens sampled, and (sequence, step) pairs that sampled: their ratio is
        self.num_decode_seq_steps = 0  # the tokens per step a sequence gets (above 1 with speculation)
        self.weight_bytes = tensor_bytes(model)
        self.memory_report = MemoryReport.build(
            quantization=config.quantization or (self.quant_spec.describe() if self.quant_spec else None),
            kv_cache_dtype=config.kv_cache_dtype, memory=self.memory,
            weights_bytes=self.weight_bytes, weights_full_precision_bytes=unquantized_bytes(model),
            num_layers=spec.num_layers, block_size=config.block_size, kv_heads=spec.num_kv_heads // tp,
            head_dim=spec.head_dim, model_dtype=model_dtype)
        self.memory_report.log()

    # adapters
    def register_adapter(self, digest: str, path: str | Path) -> None:
        """Make an adapter known by its digest; it is read lazily, in the background, when first asked for."""
        self.adapter_pool.register(digest, path)

    def add_adapter(self, path: str | Path) -> str:
        """Read an adapter now (raising adapters.AdapterError if it is unusable); returns its digest."""
        started = time.perf_counter()
        adapter = read_adapter(path, self.hf_config, self.config.max_adapter_rank, policy=read_policy(self.config))
        self.adapter_pool.add_loaded(adapter, path, seconds=time.perf_counter() - started)
        return adapter.digest

    def prefetch_adapter(self, digest: str, tier: str) -> list[str]:
        """Warm a registered adapter into "host" or on into "device" pages (evicting unpinned adapters no waiting
        request needs, never KV; the copy into pages is waited for); returns the tiers it is in. RuntimeError
        when the pages cannot be had."""
        pool = self.adapter_pool
        if tier == "device" and not pool.ready(digest):  # ready() starts a load from disk
            needed = pool.pages_to_place(digest)
            if needed is None and digest not in pool.state()["placing"]:
                raise RuntimeError(f"adapter {digest[:12]} is not in memory yet: it is loading, try again")
            if needed is not None:
                short = needed - self.block_manager.num_free_blocks
                waiting = {seq.adapter for seq in self.scheduler.waiting} - {None}
                if short > 0 and pool.reclaim(short, keep={digest, *waiting}) < short:
                    raise RuntimeError("no free pages for it: running and waiting requests need them")
                pool.place(digest)
            pool.wait_placed(digest)
        elif tier == "host":
            pool.ready(digest)
        return [t for t in ("device", "host") if digest in pool.resident()[t]]

    def pin_adapter(self, digest: str, tier: str) -> list[str]:
        """Keep a registered adapter always warm in "host" or "device" (AdapterPool.pin): read into host memory
        first, then, for "device", placed in pages as `prefetch_adapter` places it; returns the tiers it is in.
        PinRefused when the tier's pins would pass its budget (nothing is evicted for a pin refused);
        RuntimeError while it is still loading (try again) or when no pages can be had."""
        pool = self.adapter_pool
        if tier not in ("host", "device"):
            raise ValueError(f"tier must be 'host' or 'device', not {tier!r}")
        if pool.tier(digest) not in ("host", "device") or (tier == "host" and digest not in pool.resident()["host"]):
            pool.read_into_host(digest)
            raise RuntimeError(f"adapter {digest[:12]} is not in host memory yet: it is loading, try again")
        refusal = pool.pin_fits(digest, tier)
        if refusal is not None:
            raise PinRefused(refusal)
        tiers = self.prefetch_adapter(digest, tier)
        pool.pin(digest, tier)
        return tiers

    def unpin_adapter(self, digest: str) -> str | None:
        """Let a pinned adapter be evicted again; returns the tier it was pinned in (None: it was not pinned)."""
        return self.adapter_pool.unpin(digest)

    def evict_adapter(self, digest: str) -> list[str]:
        """Drop an adapter no request uses from the device and host tiers; returns the tiers it left."""
        users = [s for s in itertools.chain(self.scheduler.running, self.scheduler.waiting) if s.adapter == digest]
        if users:
            raise RuntimeError(f"adapter {digest[:12]} is in use by {len(users)} sequence(s)")
        return self.adapter_pool.evict(digest)

    # requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        adapter: str | None = None,
        tenant: str = "default",
        weight: float = 1.0,
        grammar: Grammar | None = None,
        images: list[ImageFeatures] = (),
    ) -> None:
        """grammar: compiled by `self.grammars` beforehand (never inside a step), constrains every completion;
        images: the prompt's images in order, each filling its run of image placeholder tokens."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already exists")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens; this model takes fewer than {self.max_model_len}")
        needed = self.block_manager.blocks_to_run(len(prompt_token_ids) + 1, self.config.max_num_batched_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValueError(f"prompt needs {needed} KV blocks; the cache has {self.block_manager.num_blocks}")
        vocab = self.runner.model.spec.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if sampling.logit_bias and any(t >= vocab for t in sampling.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if adapter is not None and not self.adapter_pool.is_registered(adapter):
            raise ValueError(f"adapter {adapter!r} is not registered")
        if weight <= 0:
            raise ValueError("weight must be > 0")
        placed, spec = [], self.runner.model.spec
        if images and spec.image_token_id is None:
            raise ValueError("this model takes no images")
        if spec.image_token_id is not None:
            placed = place_images(prompt_token_ids, spec.image_token_id, list(images))
        rope_positions, rope_delta = (self.runner.model.prompt_positions(len(prompt_token_ids), placed)
                                      if spec.mrope_section else (None, 0))
        unsplit = tuple((image.offset, image.offset + image.features.num_tokens) for image in placed
                        if spec.bidirectional_images)  # prefilled whole: its tokens attend both ways
        widest, room = max((end - start for start, end in unsplit), default=0), self.scheduler.max_chunk
        if widest > room:
            raise ValueError(f"an image of {widest} tokens is prefilled in one chunk; this engine's chunks hold "
                             f"at most {room} tokens (max_num_batched_tokens, long_prefill_token_threshold)")
        salt = self._cache_salt(request_id, prompt_token_ids, tenant)  # images: in their blocks' keys (marks)
        now = time.monotonic()
        seqs: list[Sequence] = []
        for index in range(sampling.n):
            seqs.append(Sequence(
                request_id=request_id, index=index, prompt_token_ids=prompt_token_ids, sampling=sampling,
                adapter=adapter, tenant=tenant, weight=weight, cache_salt=salt, arrival_time=now,
                leader=seqs[0] if seqs else None, constrained=grammar is not None, images=placed,
                rope_positions=rope_positions, rope_delta=rope_delta, unsplit=unsplit,
            ))
        self.requests[request_id] = seqs
        if adapter is not None:
            self.adapter_pool.ready(adapter)  # its load from disk starts now, not at the next step
        for seq in seqs:
            if grammar is not None:
                self.guided.add(seq, grammar)
            self.scheduler.add(seq)
            self.output_processor.add(seq)

    def _cache_salt(self, request_id: str, prompt_token_ids: list[int], tenant: str) -> str:
        salt = tenant if self.config.enable_prefix_caching else f"request:{request_id}"
        if self.runner.model.spec.rope.long_rows(len(prompt_token_ids)):
            salt += ":long-rope"  # its KV differs from a shorter prompt's over the same tokens
        return salt

    # KV blocks by key (docs/kv-tiers.md)
    def kv_keys(self, prompt_token_ids: list[int], *, adapter: str | None = None, tenant: str = "default",
                images: list[ImageFeatures] = ()) -> list[bytes]:
        """This engine's keys of the prompt's full blocks, for the request add_request would make of it (with
        these images: their digests are in the keys of their blocks and every later one)."""
        salt = self._cache_salt("", prompt_token_ids, tenant)
        marks = ()
        if images:
            placed = place_images(prompt_token_ids, self.runner.model.spec.image_token_id, list(images))
            marks = tuple((p.offset, p.offset + p.features.num_tokens, p.features.digest) for p in placed)
        return self.block_manager.keys(prompt_token_ids, adapter=adapter, salt=salt, marks=marks)

    def export_blocks(self, keys: list[bytes]) -> list[KVBlock]:
        """Copies of the cached blocks of the leading run of keys, off the device."""
        self._check_kv_movable()
        return payload.export_blocks(self.block_manager, self.memory, keys)

    def import_blocks(self, blocks: list[KVBlock], keys: list[bytes]) -> int:
        """Install blocks as cached prefix blocks where each is under this engine's own key for its place in
        `keys` (from kv_keys), after those it holds (payload.held_run); the others are refused, and recomputed."""
        self._check_kv_movable()
        return payload.import_blocks(self.block_manager, self.memory, blocks, keys, tier=self.host_tier)

    def _check_kv_movable(self) -> None:
        if self.workers is not None:
            raise RuntimeError("KV blocks cannot move in or out of a tensor-parallel engine (each rank holds a shard)")

    def abort(self, request_id: str) -> list[RequestOutput]:
        """End a request wherever it is; returns the final output of each completion not finished before."""
        outputs = []
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                self.finish_sequence(seq, "abort")
                outputs.append(self.output_processor.output(seq, []))
        return outputs

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request with finish_reason "error" (after a failed step); returns their final outputs."""
        outputs = []
        for request_id in list(self.requests):
            for seq in self.requests.pop(request_id):
                if not seq.is_finished:
                    try:
                        self.finish_sequence(seq, "error", message)
                    except Exception:  # the state may be what broke: the output still goes out
                        seq.status, seq.finish_reason, seq.error = SequenceStatus.FINISHED, "error", message
                    outputs.append(self.output_processor.output(seq, []))
        return outputs

    @property
    def image_inputs(self) -> ImageInputs | None:
        """What rendering a chat with images needs (engine.chat_prompt); None: the model takes no images."""
        processor = self.image_processor
        if processor is None:
            return None
        text = processor.prompt_text(self.tokenizer.id_to_token)  # Gemma 3: the text its processor writes
        placeholder, expansion = text if text is not None else (None, None)
        return ImageInputs(processor=processor, image_token_id=self.runner.model.spec.image_token_id,
                           placeholder=placeholder, expansion=expansion)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.num_unfinished)

    def finish_sequence(self, seq: Sequence, reason: str, error: str | None = None, error_type: str | None = None) -> None:
        if not seq.is_finished:
            if seq.first_scheduled_time is not None:  # it held a slot: from its first step until now
                held = time.monotonic() - seq.first_scheduled_time
                mean = self.request_seconds
                self.request_seconds = held if mean is None else mean + REQUEST_MEAN_WEIGHT * (held - mean)
            self.scheduler.finish(seq, reason)
            seq.error, seq.error_type = error, error_type
        self.runner.release(seq)
        self.guided.release(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        self.output_processor.close(seq)

    def step(self) -> list[RequestOutput]:
        outputs = []
        failed = self.adapter_pool.take_failures()
        if failed:
            for seq in [s for s in self.scheduler.waiting if s.adapter in failed]:
                message = f"adapter {seq.adapter[:12]} could not be loaded: {failed[seq.adapter]}"
                self.finish_sequence(seq, "error", message, ADAPTER_UNAVAILABLE)
                outputs.append(self.output_processor.output(seq, []))
        out = self.scheduler.schedule()
        self.num_preemptions += len(out.preempted)
        if out.is_empty:
            self._forget_finished(outputs)
            return outputs
        now = time.monotonic()
        for seq in out.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        start = time.perf_counter()
        proposals, draft_probs = self.speculator.propose(out) if self.speculator else ({}, {})
        results = self._run(out, proposals, draft_probs)
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        self.busy_ms += elapsed_ms
        self.num_steps += 1
        self.last_step_seqs = len(out.seqs)
        self.scheduler.on_step_done(out, {i: len(r.samples) - 1 for i, r in results.items() if r.num_proposed})
        total = out.total_tokens
        now = time.monotonic()
        for seq in out.seqs:
            seq.gpu_ms += elapsed_ms * out.num_tokens[seq.seq_id] / total
            new_tokens = self._apply(seq, results[seq.seq_id], now)
            if new_tokens or seq.is_finished:
                outputs.append(self.output_processor.output(seq, new_tokens))
        self._forget_finished(outputs)
        return outputs

    def _run(self, out, proposals, draft_probs):
        if self.workers is None:
            return self.runner.run(out, proposals, draft_probs)
        try:
            return self.runner.run(out, proposals, draft_probs)
        except Exception as error:  # a worker died or failed mid-step: name it (RankFailed)
            raise self.workers.failed(error) from error

    def _apply(self, seq: Sequence, result: StepResult, now: float) -> list[int]:
        """Apply one step's result to its sequence: the prompt log-probs it scored, then each sampled token (several
        when speculative tokens were accepted) through the grammar and the stop checks; returns the tokens emitted."""
        if result.prompt_logprobs:
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None]
            for pos, logprob, top in result.prompt_logprobs:
                if pos == len(seq.prompt_logprobs):  # a recompute after preemption scores them again
                    seq.prompt_logprobs.append(Logprob(seq.token_ids[pos], logprob, top))
        if not result.samples or seq.is_finished:
            return []
        emitted = []
        for sample in result.samples:  # several when speculative tokens were accepted
            emitted.append(sample.token_id)
            refused = self.guided.accept(seq, sample.token_id)
            reason = self.output_processor.append(seq, sample, now)
            if refused is not None:  # only a bug can get here: the mask allowed the token
                self.finish_sequence(seq, "error", f"constrained decoding failed: {refused}")
                break
            if reason is not None:
                self.finish_sequence(seq, reason)
                break
        if result.num_proposed and self.speculator is not None:  # accepted: those emitted (a stop may cut them)
            self.speculator.record(seq, result.num_proposed, min(len(result.samples) - 1, len(emitted)))
        self.num_generated_tokens += len(emitted)
        self.num_decode_seq_steps += 1
        seq.num_sampling_steps += 1
        return emitted

    def failure(self) -> str | None:
        """Why the engine cannot run another step (a tensor-parallel worker died), or None while it can."""
        return None if self.workers is None else self.workers.failure()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any, and the adapter loader (the engine runs no step after this)."""
        if self.workers is not None:
            self.workers.stop()
        if self.host_tier is not None:
            self.host_tier.close()
        self.adapter_pool.close()

    def _forget_finished(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            seqs = self.requests.get(output.request_id)
            if seqs is not None and all(s.is_finished for s in seqs):
                del self.requests[output.request_id]

    # what the engine reports about itself in /v1/state
    def memory_split(self) -> dict:
        """Bytes of base weights, KV pages, adapter pages and free pages (free includes prefix-cached blocks)."""
        bm, page = self.block_manager, self.memory.page_bytes
        return {
            "page_bytes": page,
            "pages_total": bm.num_blocks,
            "base_weights_bytes": self.weight_bytes,
            "kv_pages_bytes": bm.num_used_blocks * page,
            "adapter_pages_bytes": len(bm.adapter_pages) * page,
            "free_bytes": bm.num_free_blocks * page,
            **self.memory_report.as_dict(),
        }

    def state(self) -> dict:
        """Its memory split, queues, prefix-cache tiers and speculation."""
        bm = self.block_manager
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_blocks_total": bm.num_blocks,
            "adapter_pages": len(bm.adapter_pages),
            "memory": self.memory_split(),
            "prefix_cache_hit_rate": bm.hit_rate(),
            "kv_tiers": self.kv_tiers_state(),
            "adapters": self.adapter_pool.state(),
            "busy_ms": self.busy_ms,
            "request_seconds": self.request_seconds,  # None until a sequence that ran has finished
            "steps": self.num_steps,
            "preemptions": self.num_preemptions,
            "tensor_parallel_size": self.comm.size,
            "block_size": self.config.block_size,
            "speculation": self.speculation_state(),
            "grammars": {**(self.grammars.state() if self.grammars else {}), **self.guided.state()},
        }

    def kv_tiers_state(self) -> dict:
        """Prefix blocks looked up at first admission, hit and missed per tier (device, then host)."""
        counts = self.scheduler.tier_counts
        tiers = {"device": {"hits": counts["device"][0], "misses": counts["device"][1],
                            "blocks": len(self.block_manager.cached)}}
        if self.host_tier is not None:
            tiers["host"] = {"hits": counts["host"][0], "misses": counts["host"][1], **self.host_tier.state()}
        return tiers

    def speculation_state(self) -> dict:
        proposed = self.speculator.num_proposed if self.speculator else 0
        accepted = self.speculator.num_accepted if self.speculator else 0
        steps = self.num_decode_seq_steps
        return {
            "method": self.config.speculative_method,
            "proposed_tokens": proposed,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "tokens_per_step": self.num_generated_tokens / steps if steps else 0.0,
        }


def context_length(config: EngineConfig, spec: ModelSpec) -> int:
    """The longest sequence served: the configured max_model_len, else the model's; a sliding window limits
    what a token sees, not the context."""
    longest = spec.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > longest:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds what this model supports ({longest})")
    return config.max_model_len or longest


def spawn_workers(config: EngineConfig, *, timed: bool) -> WorkerGroup | None:
    """The tensor-parallel ranks 1..N-1, started at once so that they load their shards while rank 0 loads its
    own; None without tensor parallelism."""
    if config.tensor_parallel_size == 1:
        return None
    return WorkerGroup(model=config.model, dtype=config.dtype, device=config.device,
                       size=config.tensor_parallel_size, block_size=config.block_size,
                       quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype, timed=timed)


def build_host_tier(config: EngineConfig, block_manager: BlockManager, memory: PagedMemory) -> HostTier | None:
    """The host-memory KV tier (docs/kv-tiers.md), which keeps the prefix blocks the device evicts; None unless
    kv_host_cache_gb is set."""
    if not config.kv_host_cache_gb:
        return None
    if block_manager.window is not None:
        raise ValueError("kv_host_cache_gb: not supported for a model with a sliding window on every layer")
    tier = HostTier(memory=memory, capacity_bytes=int(config.kv_host_cache_gb * 2**30))
    block_manager.on_evict = tier.save
    return tier


def read_policy(config: EngineConfig) -> ReadPolicy:
    """How adapter loads read their files (adapters.file_reads)."""
    return ReadPolicy(bytes_per_second=config.adapter_read_bytes_per_second, uncached=config.adapter_read_uncached)


def build_adapter_pool(config: EngineConfig, hf_config: dict, spec: ModelSpec, page: PageShape, *,
                       memory: PagedMemory, block_manager: BlockManager, workers: WorkerGroup | None,
                       pin: bool) -> AdapterPool:
    """Adapters read from disk, planned into rank 0's shard of pages taken from the block manager; each worker gets
    its shard of what rank 0 read (the pool's mirror). Its callables hold no engine, so the engine has no
    reference cycle through them."""
    size, policy = config.tensor_parallel_size, read_policy(config)
    return AdapterPool(
        memory=memory,
        plan=lambda adapter: AdapterPlan.build(shard_adapter(adapter, rank=0, size=size), num_layers=spec.num_layers,
                                               widths=page.widths, chunk=page.chunk, pin=pin),
        load=lambda path, digest: read_adapter(path, hf_config, config.max_adapter_rank, digest=digest, policy=policy),
        take_pages=block_manager.take_pages,
        give_pages=block_manager.give_pages,
        host_cache_bytes=config.host_adapter_cache_bytes,
        pin_pages=count_adapter_pages(config, spec, page_bytes=memory.page_bytes, widths=page.widths,
                                      chunk=page.chunk),
        mirror=workers,
    )
