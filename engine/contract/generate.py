"""The generate request the gateway POSTs to an engine's /v1/generate, decoded and checked by its struct: a field of
the wrong type or value is a 400 naming its path (`kv_transfer.lease.id`). The prompt, the sampling parameters and
OpenAI's structured-output fields are read further by the engine server (engine/server/protocol.py), which knows
the model they must fit."""

from typing import Annotated, Any, Literal

import msgspec

from engine.contract.kv import KVTransfer
from engine.contract.usage import UsageMetadata
from engine.contract.version import VERSION, check_version

ADAPTER_FILES = ("quilt_adapter.json", "adapter_model.safetensors")  # what an engine downloads of an adapter
DIGEST_PATTERN = "^[0-9a-f]{64}$"
REQUEST_ID_PATTERN = "^[A-Za-z0-9._:@+=-]{1,100}$"
KEEP_ALIVE_SECONDS = 75  # an engine keeps an idle connection this long after an answer; a client reuses one for less

Digest = Annotated[str, msgspec.Meta(pattern=DIGEST_PATTERN)]


class AdapterRef(msgspec.Struct, forbid_unknown_fields=True):
    """The request's adapter: its digest, and where the engine finds it when its store has it not: a folder it
    reads (`path`), or signed GET URLs of its canonical files, ADAPTER_FILES (`urls`), which it downloads."""

    digest: Digest
    path: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    urls: dict[str, str] | None = None


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    request_id: Annotated[str, msgspec.Meta(pattern=REQUEST_ID_PATTERN)] | None = None  # None: the engine makes one
    tenant: Annotated[str, msgspec.Meta(min_length=1)] = "default"
    weight: Annotated[float, msgspec.Meta(gt=0)] = 1.0  # the tenant's fair share (JSON has no infinity)
    api_key_id: str | None = None
    adapter: Digest | AdapterRef | None = None  # None: the base model
    prompt: Any = None  # a string, or a batch of them
    prompt_token_ids: Any = None  # a list of token ids, or a batch of them
    messages: Any = None  # OpenAI's chat messages
    sampling: Any = msgspec.field(default_factory=dict)  # engine.sampling_params.SamplingParams' fields
    stream: bool = True
    metadata: UsageMetadata = msgspec.field(default_factory=UsageMetadata)  # echoed in the usage event
    context_overflow: Literal["cap", "refuse"] = "cap"  # "refuse": a prompt plus max_tokens past the context is a 400
    response_format: Any = None  # OpenAI's
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    kv_transfer: KVTransfer | None = None  # a hop of disaggregated serving
    v: int = VERSION

    def __post_init__(self) -> None:
        check_version("generate request", self.v)
