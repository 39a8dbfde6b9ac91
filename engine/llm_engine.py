"""The online engine: requests in, one scheduled step at a time, token deltas and usage out."""

import json
import time
from pathlib import Path

import torch

from engine.adapter_pool import AdapterPool, read_adapter
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.fairness import FirstComeFirstServed, VirtualTokenCounter
from engine.lora_linear import swap_in_lora
from engine.model_runner import ModelRunner, StepResult
from engine.models import load_model, read_hf_config
from engine.outputs import Logprob, RequestOutput, Usage
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.tokenizer import TextStream, Tokenizer

CPU_KV_CACHE_BYTES = 1 << 30
PACKED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def _eos_token_ids(model_dir: Path, hf_config: dict, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    ids = set()
    sources = [hf_config.get("eos_token_id")]
    generation_config = model_dir / "generation_config.json"
    if generation_config.exists():
        sources.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        sources.append(tokenizer.token_to_id(tokenizer.eos_token))
    for value in sources:
        ids |= set(value if isinstance(value, list) else [value] if value is not None else [])
    return tuple(sorted(ids))


class LLMEngine:
    def __init__(self, config: EngineConfig, *, policy: FirstComeFirstServed | VirtualTokenCounter | None = None):
        self.config = config
        self.device = torch.device(config.device)
        model_dir = Path(config.model)
        self.hf_config = read_hf_config(model_dir)
        model = load_model(model_dir, dtype=getattr(torch, config.dtype), device=self.device)
        args = model.args
        longest = min(args.max_position_embeddings, args.sliding_window or args.max_position_embeddings)
        if config.max_model_len is not None and config.max_model_len > longest:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds what this model supports ({longest})")
        self.max_model_len = config.max_model_len or longest
        self.tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").exists() else None
        self.eos_token_ids = _eos_token_ids(model_dir, self.hf_config, self.tokenizer)
        lora_weights = swap_in_lora(
            model, PACKED_MODULES, num_slots=config.max_adapter_slots, max_rank=config.max_adapter_rank
        )
        self.adapter_pool = AdapterPool(
            weights=lora_weights,
            num_slots=config.max_adapter_slots,
            max_rank=config.max_adapter_rank,
            host_cache_bytes=config.host_adapter_cache_bytes,
            load=lambda path: read_adapter(path, self.hf_config, config.max_adapter_rank),
        )
        num_blocks = config.num_kv_blocks or self._auto_num_blocks(model)
        self.max_model_len = min(self.max_model_len, num_blocks * config.block_size)  # one sequence must fit
        self.runner = ModelRunner(
            model=model,
            num_kv_blocks=num_blocks,
            block_size=config.block_size,
            num_slots=config.max_adapter_slots,
            eos_token_ids=self.eos_token_ids,
            device=self.device,
        )
        self.block_manager = BlockManager(
            num_blocks=num_blocks, block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            block_manager=self.block_manager,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_adapters=config.max_adapter_slots,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            policy=policy,
            adapter_ready=self.adapter_pool.ready,
        )
        self.requests: dict[str, list[Sequence]] = {}
        self.streams: dict[int, TextStream] = {}  # seq_id -> its detokenizer
        self.busy_ms = 0.0
        self.num_steps = 0
        self.num_preemptions = 0

    def _auto_num_blocks(self, model) -> int:
        per_block = ModelRunner.kv_bytes_per_block(model, self.config.block_size)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.kv_cache_memory_fraction)
        else:
            budget = CPU_KV_CACHE_BYTES
        needed = self.config.max_num_seqs * -(-self.max_model_len // self.config.block_size)
        return max(1, min(budget // per_block, needed))

    # adapters
    def register_adapter(self, digest: str, path: str | Path) -> None:
        """Make an adapter known by its digest; it is read lazily, in the background, when first asked for."""
        self.adapter_pool.register(digest, path)

    def add_adapter(self, path: str | Path) -> str:
        """Read an adapter now (raising adapters.AdapterError if it is unusable); returns its digest."""
        adapter = read_adapter(path, self.hf_config, self.config.max_adapter_rank)
        self.adapter_pool.add_loaded(adapter, path)
        return adapter.digest

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
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already exists")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens; this model takes fewer than {self.max_model_len}")
        needed = self.block_manager.blocks_needed(len(prompt_token_ids) + 1)
        if needed > self.block_manager.num_blocks:
            raise ValueError(f"prompt needs {needed} KV blocks; the cache has {self.block_manager.num_blocks}")
        vocab = self.runner.model.args.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if adapter is not None and not self.adapter_pool.is_registered(adapter):
            raise ValueError(f"adapter {adapter!r} is not registered")
        if weight <= 0:
            raise ValueError("weight must be > 0")
        salt = tenant if self.config.enable_prefix_caching else f"request:{request_id}"
        now = time.monotonic()
        seqs: list[Sequence] = []
        for index in range(sampling.n):
            seqs.append(Sequence(
                request_id=request_id, index=index, prompt_token_ids=prompt_token_ids, sampling=sampling,
                adapter=adapter, tenant=tenant, weight=weight, cache_salt=salt, arrival_time=now,
                leader=seqs[0] if seqs else None,
            ))
        self.requests[request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)
            if self.tokenizer is not None:
                self.streams[seq.seq_id] = self.tokenizer.stream(
                    prompt_token_ids, skip_special_tokens=sampling.skip_special_tokens
                )

    def abort(self, request_id: str) -> None:
        for seq in self.requests.pop(request_id, []):
            self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.num_unfinished)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if not seq.is_finished:
            self.scheduler.finish(seq, reason)
            seq.error = error
        self.runner.release(seq)
        stream = self.streams.pop(seq.seq_id, None)
        if stream is not None:
            seq.text = stream.text

    def step(self) -> list[RequestOutput]:
        outputs = []
        failed = self.adapter_pool.failures()
        for seq in [s for s in self.scheduler.waiting if s.adapter in failed]:
            self._finish(seq, "error", f"adapter {seq.adapter} failed to load: {failed[seq.adapter]}")
            outputs.append(self._output(seq, []))
        out = self.scheduler.schedule()
        self.num_preemptions += len(out.preempted)
        if out.is_empty:
            self._forget_finished(outputs)
            return outputs
        now = time.monotonic()
        for seq in out.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        start = time.perf_counter()  # busy time includes copying adapters into their slots
        needed = {seq.adapter for seq in out.seqs if seq.adapter is not None}
        slots = self.adapter_pool.activate(needed, self.scheduler.running_adapters())
        results = self.runner.run(out, slots)
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        self.busy_ms += elapsed_ms
        self.num_steps += 1
        self.scheduler.on_step_done(out)
        total = out.total_tokens
        now = time.monotonic()
        for seq in out.seqs:
            seq.gpu_ms += elapsed_ms * out.num_tokens[seq.seq_id] / total
            new_tokens = self._postprocess(seq, results[seq.seq_id], now)
            if new_tokens or seq.is_finished:
                outputs.append(self._output(seq, new_tokens))
        self._forget_finished(outputs)
        return outputs

    def _forget_finished(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            seqs = self.requests.get(output.request_id)
            if seqs is not None and all(s.is_finished for s in seqs):
                del self.requests[output.request_id]

    def _postprocess(self, seq: Sequence, result: StepResult, now: float) -> list[int]:
        if result.prompt_logprobs:
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None]
            for pos, logprob, top in result.prompt_logprobs:
                if pos == len(seq.prompt_logprobs):  # a recompute after preemption scores them again
                    seq.prompt_logprobs.append(Logprob(seq.token_ids[pos], logprob, top))
        sample = result.sample
        if sample is None or seq.is_finished:
            return []
        s = seq.sampling
        seq.append_token(sample.token_id)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if s.logprobs is not None:
            seq.logprobs.append(Logprob(sample.token_id, sample.logprob, sample.top_logprobs or {}))
        stream = self.streams.get(seq.seq_id)
        if stream is not None:
            stream.push(sample.token_id)
        token_id = sample.token_id
        if (token_id in self.eos_token_ids and not s.ignore_eos) or token_id in s.stop_token_ids:
            self._finish(seq, "stop")
        elif stream is not None and s.stop and self._truncate_at_stop(seq, stream):
            self._finish(seq, "stop")
        if not seq.is_finished and (seq.num_completion_tokens >= s.max_tokens or seq.num_tokens >= self.max_model_len):
            self._finish(seq, "length")
        return [token_id]

    @staticmethod
    def _truncate_at_stop(seq: Sequence, stream: TextStream) -> bool:
        for stop in seq.sampling.stop:
            at = stream.text.find(stop)
            if at >= 0:
                stream.text = stream.text[:at]
                return True
        return False

    def _visible_text(self, seq: Sequence) -> str:
        stream = self.streams.get(seq.seq_id)
        if stream is None:
            return seq.text
        text = stream.text
        held = 0  # hold back what may be the start of a stop string
        for stop in seq.sampling.stop:
            held = max([held] + [k for k in range(1, min(len(stop) - 1, len(text)) + 1) if text.endswith(stop[:k])])
        return text[: len(text) - held]

    def _output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        first_scheduled = seq.first_scheduled_time or time.monotonic()
        usage = Usage(
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens,
            completion_tokens=seq.num_completion_tokens,
            queue_ms=(first_scheduled - seq.arrival_time) * 1000.0,
            ttft_ms=None if seq.first_token_time is None else (seq.first_token_time - seq.arrival_time) * 1000.0,
            gpu_ms=seq.gpu_ms,
        )
        return RequestOutput(
            request_id=seq.request_id,
            index=seq.index,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.completion_token_ids,
            new_token_ids=new_tokens,
            text=self._visible_text(seq),
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            usage=usage,
            logprobs=seq.logprobs if seq.sampling.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs,
            error=seq.error,
        )

    def state(self) -> dict:
        bm = self.block_manager
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_blocks_total": bm.num_blocks,
            "prefix_cache_hit_rate": bm.hit_rate(),
            "adapters": self.adapter_pool.state(),
            "busy_ms": self.busy_ms,
            "steps": self.num_steps,
            "preemptions": self.num_preemptions,
        }
