"""What a client may ask of the sampler, validated."""

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # a temperature this small is greedy (dividing float32 logits by it overflows)
SEED_RANGE = (-(2**63), 2**63 - 1)  # what a torch.Generator takes (a 64-bit integer)
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: a bias in [-100, 100] per token
MAX_LOGIT_BIAS_TOKENS = 1024


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off; tokens of the prompt or output have positive logits / it, negative * it
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # chosen token's log-probability plus this many top ones
    prompt_logprobs: int | None = None  # log-probabilities of the prompt's tokens (0: just those)
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be a 64-bit integer, in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.logit_bias is not None:
            self._check_logit_bias()
        if any(token < 0 for token in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids (integers >= 0)")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias must map at most {MAX_LOGIT_BIAS_TOKENS} token ids to biases")
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias) \
                    or abs(bias) > LOGIT_BIAS_RANGE:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
