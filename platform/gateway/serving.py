"""What every request of one API key for one model shares, worked out once rather than per request: the metrics'
labels, the plan's rates for the model, the engine payload's and the usage metadata's fixed fields.
Kept while the key's caller and the model's target are the objects the caller cache hands out: a change to the key,
its tenant or the model (or their cache lifetime's end) makes new ones, and with them a new `Serving`."""

from gateway.caller import Caller, Target
from gateway.metrics import adapter_label
from metering.pricing import Rates

MAX_KEPT = 10_000


class Serving:
    __slots__ = ("caller", "target", "labels", "rates", "tenant", "payload", "metadata", "by_engine")

    def __init__(self, caller: Caller, target: Target):
        self.caller = caller
        self.target = target
        self.tenant = str(caller.tenant_id)
        self.labels = (self.tenant, target.name, adapter_label(target.digest))  # the request metrics' labels
        self.rates: Rates = caller.rates_for(target.base_model)
        # The engine payload's fields in their order: the ones set to None here are the request's own.
        self.payload = {
            "request_id": None, "tenant": self.tenant, "weight": caller.weight, "api_key_id": str(caller.key_id),
            "adapter": target.engine_adapter,
            "sampling": None, "stream": True,
        }  # fmt: skip
        self.metadata = {  # the usage metadata's (engine.contract.UsageMetadata), the engine's name set per request
            "model": target.name, "adapter_version_id": target.adapter_version_id, "engine": None,
        }  # fmt: skip
        self.by_engine: dict[str, dict] = {}  # `engine_metadata`'s, by engine name

    def engine_metadata(self, engine: str) -> dict:
        """The usage metadata of a request `engine` serves whole (no prefill hop): one dict per engine, shared by
        the requests' payloads (nothing changes it)."""
        metadata = self.by_engine.get(engine)
        if metadata is None:
            if len(self.by_engine) >= MAX_KEPT:
                self.by_engine.clear()
            metadata = self.by_engine[engine] = self.metadata | {"engine": engine}
        return metadata


_kept: dict[tuple[int | str, str], Serving] = {}


def serving(caller: Caller, target: Target) -> Serving:
    """The pair's Serving: the one kept if it was made for these very objects, else a new one."""
    kept = _kept.get((caller.key_id, target.name))
    if kept is None or kept.caller is not caller or kept.target is not target:
        if len(_kept) >= MAX_KEPT:  # bounded: keys and models come and go over a long life
            _kept.clear()
        kept = _kept[(caller.key_id, target.name)] = Serving(caller, target)
    return kept
