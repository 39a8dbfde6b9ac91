"""Facts metering announces, sent after they have committed; other apps subscribe (admission settles holds,
billing checks budget alerts) so that metering imports neither."""

from dataclasses import dataclass
from datetime import date
from decimal import Decimal

from django.dispatch import Signal


@dataclass(frozen=True)
class RecordedUsage:
    tenant_id: int
    request_id: str
    tokens: int  # prompt + completion, as the engine counted them
    price: Decimal
    month: date  # first day of the month it counts in
    new: bool  # False: a redelivered event, recorded before
    budgeted: bool  # the tenant's plan has a token budget or a spend limit
    api_key_prefix: str | None = None  # the key that made the request
    api_key_lineage: str | None = None  # and its lineage (ApiKey.lineage: whose budget the request counts against)


# kwargs: usages (list[RecordedUsage]). Sent for every valid event of a batch, replays included, after commit.
usage_recorded = Signal()

# kwargs: tenant_ids (set[int]). Sent after commit when the gateway's refusals went into those tenants' request logs
# (they are not usage: usage_recorded does not cover them).
requests_logged = Signal()
