"""When to speculate. A step with more running sequences than `max_batch` is compute-bound (verifying k extra
tokens per sequence is no longer nearly free), so no sequence proposes. A sequence whose acceptance rate (an
exponential moving average over its verified steps) falls below `min_acceptance` stops proposing and probes
again later, waiting twice as long after each failed probe. Verification rows move the whole step off the
pure-decode path, so a probe waits for a step where another sequence is speculating anyway, unless it has
waited twice its backoff. A new sequence starts where the engine-wide acceptance says: off (for a longer
backoff) while that is below `min_acceptance`. A sequence whose output a grammar constrains never proposes
(docs/structured-output.md). No torch."""

from dataclasses import dataclass

from engine.sequence import Sequence

EMA_WEIGHT = 0.5  # of the latest step's acceptance rate, per sequence
ENGINE_EMA_WEIGHT = 0.1  # of the latest verified step, engine-wide
FIRST_BACKOFF = 4  # steps off after the first failure
COLD_BACKOFF = 32  # steps off for a new sequence while the engine-wide acceptance is low
MAX_BACKOFF = 256


@dataclass
class Acceptance:
    rate: float | None = None  # None: no verified step since the last switch
    skip: int = 0  # steps until the next probe (negative: overdue, waiting for a step that speculates)
    off_for: int = 0  # the backoff of the current switch-off
    backoff: int = FIRST_BACKOFF  # the next one


class SpeculationPolicy:
    def __init__(self, *, num_tokens: int, max_batch: int, min_acceptance: float, max_model_len: int) -> None:
        self.num_tokens = num_tokens
        self.max_batch = max_batch
        self.min_acceptance = min_acceptance
        self.max_model_len = max_model_len
        self.states: dict[int, Acceptance] = {}  # seq_id -> its acceptance
        self.speculating: set[int] = set()  # seq_ids currently on
        self.rate: float | None = None  # engine-wide acceptance

    def lookahead(self, seq: Sequence, batch_size: int) -> int:
        """Tokens seq may propose this step (0: none)."""
        if batch_size > self.max_batch or seq.constrained:
            return 0
        state = self.states.get(seq.seq_id)
        if state is None:
            state = self.states[seq.seq_id] = Acceptance()
            if self.rate is not None and self.rate < self.min_acceptance:
                state.backoff = COLD_BACKOFF
                self._switch_off(seq, state)
            else:
                self.speculating.add(seq.seq_id)
        if seq.seq_id not in self.speculating:
            state.skip -= 1
            if state.skip >= 0 or (not self.speculating and state.skip >= -state.off_for):
                return 0
        # never propose past max_tokens or the model's length: the last emitted token is sampled, not proposed
        room = min(seq.sampling.max_tokens - seq.num_completion_tokens, self.max_model_len - seq.num_tokens) - 1
        return max(0, min(self.num_tokens, room))

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        rate = accepted / proposed
        self.rate = rate if self.rate is None else (1 - ENGINE_EMA_WEIGHT) * self.rate + ENGINE_EMA_WEIGHT * rate
        state = self.states.setdefault(seq.seq_id, Acceptance())
        state.rate = rate if state.rate is None else (1 - EMA_WEIGHT) * state.rate + EMA_WEIGHT * rate
        if state.rate < self.min_acceptance:
            self._switch_off(seq, state)
        else:
            state.backoff = FIRST_BACKOFF
            self.speculating.add(seq.seq_id)

    def _switch_off(self, seq: Sequence, state: Acceptance) -> None:
        state.skip = state.off_for = state.backoff
        state.rate = None
        state.backoff = min(2 * state.backoff, MAX_BACKOFF)
        self.speculating.discard(seq.seq_id)

    def release(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)
        self.speculating.discard(seq.seq_id)
