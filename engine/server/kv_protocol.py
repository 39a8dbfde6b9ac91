"""The internal API's `kv_transfer` field: a hop of disaggregated serving (docs/kv-tiers.md) and the lease a decode
hop pulls under, parsed and checked."""

import re
from dataclasses import dataclass
from typing import Any

from engine.kv.transport import transfer_address
from engine.server.body_checks import BadRequest, is_int, is_number, object_fields

LEASE_TTL_S = (30.0, 600.0)  # kv_transfer prefill: the default and the longest lease
LEASE_ID = re.compile(r"^[0-9a-f]{16,64}$")


@dataclass(frozen=True)
class KVTransfer:
    """A hop of disaggregated serving (docs/kv-tiers.md): "prefill" computes the prompt's KV and leases its full
    blocks; "decode" pulls them under `lease` (the prefill hop's kv_lease object) before it serves as usual."""

    mode: str  # "prefill" | "decode"
    lease_ttl_s: float = LEASE_TTL_S[0]  # prefill
    lease: dict | None = None  # decode: {"id", "engine_id", "transport": {"tcp", "shm"}, "num_blocks", ...}
    lease_problem: str | None = None  # decode: why the lease cannot be pulled (then the prompt is recomputed)


def parse_kv_transfer(value: Any) -> KVTransfer | None:
    """null; {"mode": "prefill", "lease_ttl_s"?}; or {"mode": "decode", "lease": <a prefill hop's kv_lease>}."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("mode") not in ("prefill", "decode"):
        raise BadRequest("kv_transfer must be {'mode': 'prefill', 'lease_ttl_s'?} or {'mode': 'decode', 'lease': "
                         "{...}}", param="kv_transfer.mode")
    if value["mode"] == "prefill":
        value = object_fields(value, {"mode", "lease_ttl_s"}, what="kv_transfer")
        ttl = value.get("lease_ttl_s", LEASE_TTL_S[0])
        if not is_number(ttl) or not 0 < ttl <= LEASE_TTL_S[1]:
            raise BadRequest(f"kv_transfer.lease_ttl_s must be a number of seconds in (0, {LEASE_TTL_S[1]:g}]",
                             param="kv_transfer.lease_ttl_s")
        return KVTransfer(mode="prefill", lease_ttl_s=float(ttl))
    value = object_fields(value, {"mode", "lease"}, what="kv_transfer")
    if not isinstance(value.get("lease"), dict):
        raise BadRequest("kv_transfer.lease must be the kv_lease object of a prefill hop's answer",
                         param="kv_transfer.lease")
    lease = value["lease"]
    return KVTransfer(mode="decode", lease=lease, lease_problem=lease_problem(lease))


LEASE_FIELDS = {"id", "engine_id", "transport", "num_blocks", "num_tokens", "expires_in_s"}


def lease_problem(lease: dict) -> str | None:
    """Why a decode hop cannot pull under this lease, naming the field by its path; None when it can. The lease is
    the prefill engine's answer, not the client's: one this engine cannot read (another version's field, an address
    it cannot parse) is a reason to recompute the prompt, never a 400 (docs/kv-tiers.md, "Failure rules")."""
    unknown = sorted(set(lease) - LEASE_FIELDS)
    if unknown:
        return f"kv_transfer.lease.{unknown[0]} is not a lease field this engine knows"
    if not isinstance(lease.get("id"), str) or not LEASE_ID.match(lease["id"]):
        return "kv_transfer.lease.id is not the hex id of a prefill hop's kv_lease"
    transport = lease.get("transport")
    if not isinstance(transport, dict):
        return "kv_transfer.lease.transport is not an object"
    unknown = sorted(set(transport) - {"tcp", "shm"})
    if unknown:
        return f"kv_transfer.lease.transport.{unknown[0]} is not a transport this engine knows"
    if transfer_address(transport.get("tcp")) is None:
        return f"kv_transfer.lease.transport.tcp is not 'host:port': {transport.get('tcp')!r}"
    if transport.get("shm") is not None and not isinstance(transport["shm"], str):
        return "kv_transfer.lease.transport.shm is not a string or null"
    for name in ("num_blocks", "num_tokens"):
        if name in lease and not (is_int(lease[name]) and lease[name] >= 0):
            return f"kv_transfer.lease.{name} is not a non-negative integer"
    if "expires_in_s" in lease and not is_number(lease["expires_in_s"]):
        return "kv_transfer.lease.expires_in_s is not a number"
    if "engine_id" in lease and not isinstance(lease["engine_id"], str):
        return "kv_transfer.lease.engine_id is not a string"
    return None
