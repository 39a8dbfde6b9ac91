"""Settling a request's budget hold: what the gateway calls when a request ends and what metering calls when
its usage event arrives. Whichever comes first replaces the hold by the actual usage; the other changes nothing."""

from decimal import Decimal

from gateway.admission import admission_settle_sync, spend_to_micros


def hold_settle(*, tenant_id: int, request_id: str, tokens: int, spend: Decimal) -> bool:
    """Records `tokens` and `spend` against the tenant's month once per request id and releases its hold.
    Returns True if this call released a live hold, False if the request was already settled or its hold had
    expired (the usage still counts in the second case)."""
    return admission_settle_sync(
        tenant_id=tenant_id, request_id=request_id, tokens=tokens, spend_micros=spend_to_micros(spend)
    )
