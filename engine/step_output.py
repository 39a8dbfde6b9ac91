"""What one step's result does to a sequence of LLMEngine: its prompt log-probs, then its sampled tokens."""

from typing import TYPE_CHECKING

from engine.model_runner import StepResult
from engine.outputs import Logprob
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def apply(engine: "LLMEngine", seq: Sequence, result: StepResult, now: float) -> list[int]:
    """Apply one step's result to its sequence: the prompt log-probs it scored, then each sampled token (several when
    speculative tokens were accepted) through the grammar and the stop checks; returns the tokens emitted."""
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
        refused = engine.guided.accept(seq, sample.token_id)
        reason = engine.output_processor.append(seq, sample, now)
        if refused is not None:  # only a bug can get here: the mask allowed the token
            engine.finish_sequence(seq, "error", f"constrained decoding failed: {refused}")
            break
        if reason is not None:
            engine.finish_sequence(seq, reason)
            break
    if result.num_proposed and engine.speculator is not None:  # accepted: those emitted (a stop may cut them)
        engine.speculator.record(seq, result.num_proposed, min(len(result.samples) - 1, len(emitted)))
    engine.num_generated_tokens += len(emitted)
    engine.num_decode_seq_steps += 1
    seq.num_sampling_steps += 1
    return emitted
