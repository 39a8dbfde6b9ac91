"""The engine's state and heartbeat as they cross to the control plane: JSON there and back, and the errors a
malformed one or one of another version gets, each naming what is wrong (never a KeyError)."""

import msgspec
import pytest

from engine.contract import (
    VERSION,
    AdapterResidency,
    BadState,
    EngineState,
    Heartbeat,
    StateAnswer,
    WrongVersion,
    state_read,
)
from tests.engine_states import adapters, engine_state, engine_state_json

DIGEST = "ab" * 32


def residency_state() -> EngineState:
    return engine_state(running=2, waiting=1, adapters=adapters(
        gpu=[DIGEST], host=[DIGEST], pinned={DIGEST: "device"},
        residency=[AdapterResidency(DIGEST, "device", True, 16), AdapterResidency(DIGEST, "host", False, 16)]))


def heartbeat_json(**changes) -> dict:
    body = {"name": "gpu-7", "url": "http://10.0.0.7:8100", "interval_s": 2.0,
            "state": msgspec.to_builtins(residency_state())}  # fmt: skip
    return body | changes


def test_a_state_round_trips_through_json_with_its_version():
    data = msgspec.json.decode(msgspec.json.encode(residency_state()))
    assert data["v"] == VERSION
    assert data["adapters"]["residency"][0] == {"digest": DIGEST, "tier": "device", "pinned": True, "rank": 16}
    assert data["adapters"]["pinned"] == {DIGEST: "device"} and data["adapters"]["load_seconds"] == {}
    state = state_read(data)
    assert state == residency_state() and state.load == 3 and state.resident_digests() == {DIGEST}


def test_a_state_answer_is_read_as_the_state_it_begins_with():
    """GET /v1/state answers a StateAnswer; what routing reads of it is its EngineState."""
    extras = {"running_requests": [], "waiting_requests": [], "steps_per_second": 0.0,
              "last_step": {"sequences": 0, "adapters": []}, "tensor_parallel_size": 1, "block_size": 16,
              "kv_pulls_in_flight": 0, "kv_tiers": {}, "kv_leases": {}, "speculation": {}, "grammars": {}}  # fmt: skip
    answer = state_read(engine_state_json() | extras, StateAnswer)
    assert isinstance(answer, StateAnswer) and answer.block_size == 16
    assert state_read(engine_state_json() | extras) == engine_state()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda s: s.update(running="two"), "$.running"),
        (lambda s: s.pop("capacity"), "capacity"),
        (lambda s: s.update(capacity=0), "$.capacity"),
        (lambda s: s.update(role="encode"), "$.role"),
        (lambda s: s["adapters"].update(gpu=["not-a-digest"]), "$.adapters.gpu[0]"),
        (lambda s: s["adapters"]["residency"][0].update(rank=-1), "$.adapters.residency[0].rank"),
        (lambda s: s["adapters"]["residency"][0].update(tier="disk"), "$.adapters.residency[0].tier"),
        (lambda s: s["adapters"]["pinned"].update({DIGEST: "gpu"}), "$.adapters.pinned"),
        (lambda s: s["adapters"]["load_seconds"].update(disk_host=-0.5), "$.adapters.load_seconds.disk_host"),
        (lambda s: s["kv_pool"].pop("in_use"), "in_use"),
        (lambda s: s.update(prefixes=["zz"]), "$.prefixes[0]"),
    ],
)
def test_a_malformed_state_is_refused_naming_the_field(change, field):
    data = msgspec.to_builtins(residency_state())
    change(data)
    with pytest.raises(BadState) as refused:
        state_read(data)
    assert field in str(refused.value) and not isinstance(refused.value, WrongVersion)
    body = heartbeat_json(state=data)
    with pytest.raises(BadState) as refused:
        state_read(body, Heartbeat)
    assert field.replace("$", "$.state") in str(refused.value) if field.startswith("$") else field in str(refused.value)


def test_a_state_of_another_version_is_refused_naming_the_version():
    other = engine_state_json() | {"v": VERSION + 1}
    for data in (other, other | {"running": "two"}, {"v": VERSION + 1}):
        with pytest.raises(WrongVersion) as refused:
            state_read(data)
        assert f"engine state version {VERSION + 1}" in str(refused.value)
    with pytest.raises(WrongVersion, match=f"heartbeat version {VERSION + 1}"):
        state_read(heartbeat_json(v=VERSION + 1), Heartbeat)
    with pytest.raises(WrongVersion, match=f"engine state version {VERSION + 1}"):
        state_read(heartbeat_json(state=other), Heartbeat)


def test_a_heartbeat_names_its_own_malformed_fields():
    for body, field in [(heartbeat_json(interval_s="2"), "$.interval_s"), (heartbeat_json(role="prefill"), "role"),
                        (heartbeat_json(name=""), "$.name"), ({"name": "gpu-7"}, "url")]:  # fmt: skip
        with pytest.raises(BadState, match="heartbeat") as refused:
            state_read(body, Heartbeat)
        assert field in str(refused.value)
    assert state_read(heartbeat_json(), Heartbeat).state == residency_state()
