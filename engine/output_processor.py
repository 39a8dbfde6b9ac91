"""From sampled tokens to what a client sees: each sequence's detokenized text (stop strings cut off and held
back while they may be starting), its logprobs, why it finished, and its usage."""

import time

from engine.outputs import Logprob, RequestOutput, Usage
from engine.sampler import Sample
from engine.sequence import Sequence
from engine.tokenizer import TextStream, Tokenizer


class OutputProcessor:
    def __init__(self, *, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.streams: dict[int, TextStream] = {}  # seq_id -> its detokenizer

    def add(self, seq: Sequence) -> None:
        if self.tokenizer is not None:
            self.streams[seq.seq_id] = self.tokenizer.stream(
                seq.prompt_token_ids, skip_special_tokens=seq.sampling.skip_special_tokens
            )

    def close(self, seq: Sequence) -> None:
        """The sequence finished: its text is final."""
        stream = self.streams.pop(seq.seq_id, None)
        if stream is not None:
            seq.text = stream.text

    def append(self, seq: Sequence, sample: Sample, now: float) -> str | None:
        """Add a sampled token; returns why the sequence now finishes ("stop", "length") or None."""
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
            return "stop"
        if stream is not None and s.stop and self._truncate_at_stop(seq, stream):
            return "stop"
        if seq.num_completion_tokens >= s.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

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

    def output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        first_scheduled = seq.first_scheduled_time or time.monotonic()
        usage = Usage(
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens,
            completion_tokens=seq.num_completion_tokens,
            queue_ms=(first_scheduled - seq.arrival_time) * 1000.0,
            ttft_ms=None if seq.first_token_time is None else (seq.first_token_time - seq.arrival_time) * 1000.0,
            gpu_ms=seq.gpu_ms,
            spec_proposed_tokens=seq.num_spec_proposed,
            spec_accepted_tokens=seq.num_spec_accepted,
            sampling_steps=seq.num_sampling_steps,
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
            logprobs=list(seq.logprobs) if seq.sampling.logprobs is not None else None,  # as of this step: the list grows
            prompt_logprobs=seq.prompt_logprobs,
            error=seq.error,
            error_type=seq.error_type,
        )
