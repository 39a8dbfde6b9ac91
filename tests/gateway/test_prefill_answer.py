"""A prefill engine's answer as the gateway reads it (engine.contract.kv.PrefillAnswer): the lease it passes on to
the decode engine and the hop's GPU time; an answer without a usable lease is a failed hop naming the field."""

import msgspec
import pytest

from engine.contract import KVLease, PrefillShare
from gateway.disaggregation import PrefillFailed, decode_payload, hop_read
from gateway.engine_client import EngineRef

ENGINE = EngineRef(name="prefill-0", url="http://p", token="", pool="", gpu_price_per_hour="1", resident=frozenset(),
                   load=0)  # fmt: skip
LEASE = {"id": "ab" * 16, "engine_id": "p0", "transport": {"tcp": "10.0.0.2:7070", "shm": None, "nixl": None}, "num_blocks": 2,
         "num_tokens": 8, "expires_in_s": 30.0, "v": 1}  # fmt: skip


def test_an_answer_is_read_into_the_lease_and_the_hops_share():
    hop = hop_read(ENGINE, {"kv_lease": LEASE, "usage": {"prompt_tokens": 9, "cached_tokens": 4, "gpu_seconds": 0.25}})
    assert hop.lease == msgspec.convert(LEASE, KVLease)
    assert hop.attribution() == PrefillShare(engine="prefill-0", gpu_ms=250.0, cached_tokens=4)
    sent = msgspec.json.decode(msgspec.json.encode(decode_payload({"prompt": "x"}, hop)))
    assert sent["kv_transfer"] == {"mode": "decode", "lease": LEASE}  # passed on as the prefill engine wrote it


@pytest.mark.parametrize(("answer", "field"), [
    ({"usage": {}}, "missing required field `kv_lease`"),
    ({"kv_lease": LEASE | {"id": "not-hex!"}}, "$.kv_lease.id"),
    ({"kv_lease": {k: v for k, v in LEASE.items() if k != "transport"}}, "`transport` - at `$.kv_lease`"),
    ({"kv_lease": LEASE, "usage": {"gpu_seconds": -1}}, "$.usage.gpu_seconds"),
], ids=["no-lease", "lease-id", "no-transport", "negative-time"])  # fmt: skip
def test_an_answer_without_a_usable_lease_fails_the_hop_naming_why(answer, field):
    with pytest.raises(PrefillFailed) as failed:
        hop_read(ENGINE, answer)
    assert failed.value.reason == "bad_answer" and field in str(failed.value)
