"""When to speculate: a step with more running sequences than `max_batch` is compute-bound (verifying k
extra tokens per sequence is no longer nearly free), so no sequence proposes; a sequence whose acceptance
rate (an exponential moving average over its verified steps) falls below `min_acceptance` stops proposing
for a while and probes again later, waiting twice as long after each failed probe. No torch."""

from dataclasses import dataclass

from engine.sequence import Sequence

EMA_WEIGHT = 0.5  # of the latest step's acceptance rate
FIRST_BACKOFF = 4  # steps off after the first failure
MAX_BACKOFF = 256


@dataclass
class Acceptance:
    rate: float | None = None  # None: no verified step since the last switch
    skip: int = 0  # steps left before the next probe
    backoff: int = FIRST_BACKOFF


class SpeculationPolicy:
    def __init__(self, *, num_tokens: int, max_batch: int, min_acceptance: float, max_model_len: int) -> None:
        self.num_tokens = num_tokens
        self.max_batch = max_batch
        self.min_acceptance = min_acceptance
        self.max_model_len = max_model_len
        self.states: dict[int, Acceptance] = {}  # seq_id -> its acceptance

    def lookahead(self, seq: Sequence, batch_size: int) -> int:
        """Tokens seq may propose this step (0: none)."""
        if batch_size > self.max_batch:
            return 0
        state = self.states.get(seq.seq_id)
        if state is not None and state.skip > 0:
            state.skip -= 1
            return 0
        # never propose past max_tokens or the model's length: the last emitted token is sampled, not proposed
        room = min(seq.sampling.max_tokens - seq.num_completion_tokens, self.max_model_len - seq.num_tokens) - 1
        return max(0, min(self.num_tokens, room))

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        state = self.states.setdefault(seq.seq_id, Acceptance())
        rate = accepted / proposed
        state.rate = rate if state.rate is None else (1 - EMA_WEIGHT) * state.rate + EMA_WEIGHT * rate
        if state.rate < self.min_acceptance:
            state.skip, state.rate = state.backoff, None
            state.backoff = min(2 * state.backoff, MAX_BACKOFF)
        else:
            state.backoff = FIRST_BACKOFF

    def release(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)
