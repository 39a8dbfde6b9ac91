"""The generate request's `kv_transfer` (engine.contract.kv, decoded by its struct) as the server acts on it: a hop
of disaggregated serving (docs/kv-tiers.md) and, for a decode hop, whether this engine can reach the lease's source."""

from dataclasses import dataclass

from engine.contract.kv import LEASE_TTL_S, DecodeHop, KVLease, PrefillHop
from engine.kv.transport import transfer_address


@dataclass(frozen=True)
class KVTransfer:
    """A hop of disaggregated serving (docs/kv-tiers.md): "prefill" computes the prompt's KV and leases its full
    blocks; "decode" pulls them under `lease` (the prefill hop's kv_lease) before it serves as usual."""

    mode: str  # "prefill" | "decode"
    lease_ttl_s: float = LEASE_TTL_S[0]  # prefill
    lease: KVLease | None = None  # decode
    lease_problem: str | None = None  # decode: why the lease's source cannot be reached (the prompt is recomputed)


def kv_transfer_of(hop: PrefillHop | DecodeHop | None) -> KVTransfer | None:
    if hop is None:
        return None
    if isinstance(hop, PrefillHop):
        return KVTransfer(mode="prefill", lease_ttl_s=hop.lease_ttl_s)
    return KVTransfer(mode="decode", lease=hop.lease, lease_problem=address_problem(hop.lease))


def address_problem(lease: KVLease) -> str | None:
    """Why this engine cannot reach the lease's source, naming the field by its path; None when it can. The address
    is the prefill engine's, well formed but perhaps not one this engine reads (a host name it cannot resolve): a
    reason to recompute the prompt, never a 400 (docs/kv-tiers.md, "Failure rules")."""
    if transfer_address(lease.transport.tcp) is None:
        return f"kv_transfer.lease.transport.tcp is not 'host:port': {lease.transport.tcp!r}"
    return None
