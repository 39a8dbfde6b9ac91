"""The usage event as it crosses from the engine (or the gateway) to metering: JSON there and back, and the errors a
malformed event or one of another version gets, each naming what is wrong."""

import re
from datetime import UTC, datetime

import msgspec
import pytest

from engine.contract import (
    VERSION,
    BadUsageEvent,
    PrefillShare,
    UsageEvent,
    UsageMetadata,
    WrongVersion,
    usage_event_read,
)


def event(**changes) -> UsageEvent:
    fields = dict(
        request_id="req-1", tenant="acme", api_key_id="key-1", adapter_digest="ab" * 32, base_model="demo",
        prompt_tokens=12, cached_tokens=4, completion_tokens=7, gpu_ms=3.5, queue_ms=0.25, ttft_ms=8.0, e2e_ms=20.0,
        finish_reason="stop", finished_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        metadata=UsageMetadata(model="support-bot", adapter_version_id=7, engine="gpu-0",
                               prefill=PrefillShare(engine="gpu-1", gpu_ms=2.0, cached_tokens=4)),
    )  # fmt: skip
    return UsageEvent(**{**fields, **changes})


def sent(**changes) -> dict:
    """The event as Celery delivers it: decoded JSON."""
    return msgspec.json.decode(msgspec.json.encode(event())) | changes


def test_an_event_round_trips_through_json_with_its_version():
    data = sent()
    assert data["finished_at"] == "2026-01-02T03:04:05Z"
    assert data["v"] == VERSION
    assert data["metadata"] == {"model": "support-bot", "adapter_version_id": 7, "engine": "gpu-0",
                                "prefill": {"engine": "gpu-1", "gpu_ms": 2.0, "cached_tokens": 4}}  # fmt: skip
    assert usage_event_read(data) == event()
    assert usage_event_read(msgspec.to_builtins(event())) == event()


def test_metadata_the_gateway_did_not_send_is_left_out_and_read_as_empty():
    data = msgspec.to_builtins(event(metadata=UsageMetadata(engine="gpu-0")))
    assert data["metadata"] == {"engine": "gpu-0"}
    del data["metadata"]
    assert usage_event_read(data).metadata == UsageMetadata()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"finish_reason": "done"}, "at `$.finish_reason`"),
        ({"prompt_tokens": -1}, "at `$.prompt_tokens`"),
        ({"prompt_tokens": 2**40, "cached_tokens": 0}, "at `$.prompt_tokens`"),
        ({"cached_tokens": 13}, "cached_tokens cannot exceed prompt_tokens"),
        ({"gpu_ms": float("nan")}, "at `$.gpu_ms`"),
        ({"finished_at": "2026-01-01T00:00:00"}, "at `$.finished_at`"),
        ({"finished_at": "2026-13-45T00:00:00Z"}, "at `$.finished_at`"),
        ({"metadata": {"prefill": {"gpu_ms": 5}}}, "missing required field `engine` - at `$.metadata.prefill`"),
        ({"metadata": {"adapter_version_id": "7"}}, "at `$.metadata.adapter_version_id`"),
        ({"tenant": ""}, "at `$.tenant`"),
    ],
    ids=["unknown-finish-reason", "negative-tokens", "past-the-columns", "cached-above-prompt", "nan-gpu-time",
         "naive-time", "no-such-day", "prefill-without-engine", "version-id-as-text", "no-tenant"],
)  # fmt: skip
def test_a_malformed_event_is_refused_naming_its_field(changes, message):
    with pytest.raises(BadUsageEvent, match=re.escape(message)):
        usage_event_read(sent(**changes))


def test_a_missing_field_is_named():
    data = sent()
    del data["tenant"]
    with pytest.raises(BadUsageEvent, match="missing required field `tenant`"):
        usage_event_read(data)


def test_an_event_of_another_version_is_refused_for_its_version_not_its_fields():
    newer = {"v": VERSION + 1, "request_id": "req-1", "tenant_ref": "acme", "tokens": {"prompt": 12}}
    with pytest.raises(WrongVersion, match=f"usage event version {VERSION + 1} is not the version this side speaks"):
        usage_event_read(newer)
    with pytest.raises(WrongVersion, match="usage event version"):
        usage_event_read(sent(v=VERSION + 1))
    with pytest.raises(WrongVersion):
        event(v=VERSION + 1)  # nor does this side make one
