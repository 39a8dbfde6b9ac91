"""The generate request and its KV lease as an engine decodes them: what the gateway sends is read whole, and a field
of the wrong shape is refused naming its path."""

import msgspec
import pytest

from engine.contract import VERSION, AdapterRef, GenerateRequest, KVLease
from engine.contract.kv import DecodeHop, PrefillHop

decode = msgspec.json.Decoder(GenerateRequest).decode
LEASE = {"id": "ab" * 16, "engine_id": "prefill-0", "transport": {"tcp": "10.0.0.2:7070", "shm": "/quilt-kv-1", "nixl": None},
         "num_blocks": 3, "num_tokens": 12, "expires_in_s": 30.0}  # fmt: skip


def test_a_gateway_request_is_read_whole():
    sent = {"request_id": "r-1", "tenant": "7", "weight": 2.0, "api_key_id": "k.1", "adapter": {"digest": "ab" * 32,
            "path": "/adapters/x"}, "sampling": {"max_tokens": 4}, "stream": True, "prompt": "hi",
            "metadata": {"model": "bot", "adapter_version_id": 3, "engine": "gpu-0"},
            "kv_transfer": {"mode": "decode", "lease": LEASE}}  # fmt: skip
    request = decode(msgspec.json.encode(sent))
    assert request.adapter == AdapterRef(digest="ab" * 32, path="/adapters/x")
    assert request.kv_transfer == DecodeHop(lease=msgspec.convert(LEASE, KVLease))
    assert request.metadata.engine == "gpu-0" and request.v == VERSION
    assert decode(b'{"prompt": "hi", "adapter": "' + b"cd" * 32 + b'"}').adapter == "cd" * 32
    assert decode(b'{"prompt": "hi", "kv_transfer": {"mode": "prefill"}}').kv_transfer == PrefillHop(lease_ttl_s=30.0)


def test_a_lease_round_trips_as_the_prefill_engine_answers_it():
    lease = msgspec.convert(LEASE, KVLease)
    assert msgspec.to_builtins(lease) == LEASE | {"v": VERSION}


@pytest.mark.parametrize(("sent", "path"), [
    ({"kv_transfer": {"mode": "decode", "lease": LEASE | {"id": "not-hex!"}}}, "$.kv_transfer.lease.id"),
    ({"kv_transfer": {"mode": "decode", "lease": LEASE | {"num_blocks": -1}}}, "$.kv_transfer.lease.num_blocks"),
    ({"kv_transfer": {"mode": "decode", "lease": LEASE | {"transport": {"tcp": "h:1", "rdma": {}}}}},
     "$.kv_transfer.lease.transport"),
    ({"kv_transfer": {"mode": "prefill", "lease_ttl_s": 3600}}, "$.kv_transfer.lease_ttl_s"),
    ({"kv_transfer": {"mode": "both"}}, "$.kv_transfer.mode"),
    ({"adapter": {"digest": "xyz"}}, "$.adapter.digest"),
    ({"weight": 0}, "$.weight"),
    ({"metadata": {"prefill": {"gpu_ms": 1}}}, "$.metadata.prefill"),
], ids=["lease-id", "lease-blocks", "lease-transport", "lease-ttl", "mode", "digest", "weight", "prefill-share"])  # fmt: skip
def test_a_malformed_request_is_refused_naming_the_field(sent, path):
    with pytest.raises(msgspec.ValidationError, match=f"at `{path.replace('$', '[$]')}`"):
        decode(msgspec.json.encode({"prompt": "hi"} | sent))


def test_a_request_or_lease_of_another_version_is_refused_for_its_version():
    with pytest.raises(msgspec.ValidationError, match=f"generate request version {VERSION + 1} is not"):
        decode(msgspec.json.encode({"prompt": "hi", "v": VERSION + 1}))
    newer = {"prompt": "hi", "kv_transfer": {"mode": "decode", "lease": LEASE | {"v": VERSION + 1}}}
    with pytest.raises(msgspec.ValidationError, match=f"kv lease version {VERSION + 1} is not"):
        decode(msgspec.json.encode(newer))
