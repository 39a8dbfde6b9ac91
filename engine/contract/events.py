"""The generate stream: NDJSON lines of deltas while a request runs, then one final event, tagged by "type" (one
Struct each; the union is StreamEvent). A request answered whole (stream false) is its final event alone.

A completion's first delta with tokens carries `prompt_tokens`, its prompt's token count (a client that shows usage
in every chunk has it before the final event); with sampling.prompt_logprobs, the same delta and the final choice
carry `prompt_logprobs`, the first entry's logprob null. A batch of prompts has n completions per prompt, indexed
prompt * n + i. Tool calls (engine/tool_calls.py) stream as OpenAI's: {"index", "id", "name", "arguments": ""} when a
call starts, then {"index", "arguments": fragment}; the final choice has each call whole.

The final event carries the contract's version `v`: a stream of another version ends in WrongVersion, not in a field
read as another."""

from typing import Any

import msgspec

from engine.contract.version import VERSION, check_version

EVENT_DELTA = "delta"
EVENT_FINAL = "final"


class Logprob(msgspec.Struct):
    token_id: int
    logprob: float | None  # None: the prompt's first token (nothing precedes it)
    top: dict[int, float] = {}


class Delta(msgspec.Struct, tag_field="type", tag=EVENT_DELTA, omit_defaults=True, kw_only=True):
    request_id: str
    index: int
    text: str
    token_ids: list[int]
    tool_calls: list[dict[str, Any]] | None = None
    logprobs: list[Logprob] | None = None
    prompt_tokens: int | None = None  # a completion's first delta with tokens
    prompt_logprobs: list[Logprob] | None = None


class KVPull(msgspec.Struct):
    """A decode hop's pull under its lease (docs/kv-tiers.md)."""

    lease_id: str
    blocks_pulled: int = 0
    recomputed: bool = False  # some blocks the lease was for were computed here instead


class FinalUsage(msgspec.Struct):
    """The counts of the request's usage event (engine.contract.UsageEvent), streamed or not."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    gpu_ms: float = 0.0
    queue_ms: float = 0.0
    ttft_ms: float | None = None
    e2e_ms: float = 0.0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    sampling_steps: int = 0
    kv_transfer: KVPull | None = None  # a decode hop's; null for any other request


class Choice(msgspec.Struct, omit_defaults=True):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    error: str | None
    error_type: str | None
    tool_calls: list[dict[str, Any]] | None = None
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob] | None = None


class Final(msgspec.Struct, tag_field="type", tag=EVENT_FINAL, kw_only=True):
    """The request's end. `text`, `token_ids` and `finish_reason` are completion 0's; `error` and `error_type` the
    first failed choice's (error_type ADAPTER_UNAVAILABLE: only this request's adapter could not be served)."""

    request_id: str
    finish_reason: str
    text: str = ""
    token_ids: list[int] = []
    error: str | None = None
    error_type: str | None = None
    choices: list[Choice] = []
    usage: FinalUsage = msgspec.field(default_factory=FinalUsage)
    v: int = VERSION

    def __post_init__(self) -> None:
        check_version("generate stream", self.v)


StreamEvent = Delta | Final
