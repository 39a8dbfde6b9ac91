"""The request log: one row per request metering recorded (UsageEvent), filtered, sorted and paged by cursor.

Paging is by keyset, never by offset: a page is "the `limit` rows after this (sort value, id)", so page 10,000 of a
10-million-row log costs what page 1 does, and rows arriving meanwhile never shift a page. The newest-first order
per tenant walks the index usage_log_tenant (tenant, -finished_at, -id); per key usage_log_key; across tenants
usage_log_all. Other orders (latency, cost, tokens) sort the filtered rows, so they want a narrow time window.

A cursor is opaque to clients: base64 of JSON [sort key, value, id].
"""

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from django.db.models import F, Q, QuerySet, Sum, Value
from django.db.models.functions import Coalesce

from metering.models import REFUSED, RequestBody, UsageEvent
from metering.selectors import RequestCounts, request_count_aggregates
from tenancy.audit import Actor
from tenancy.authority import actor_role
from tenancy.models import Membership, Tenant
from tenancy.roles import role_at_least

# Public sort key -> the expression ordered by (a coalesce keeps rows with no latency in a keyset order).
SORTS = {
    "time": F("finished_at"),
    "latency": Coalesce(F("e2e_ms"), Value(-1.0)),
    "ttft": Coalesce(F("ttft_ms"), Value(-1.0)),
    "cost": F("price"),
    "tokens": F("prompt_tokens") + F("completion_tokens"),
}
# A status and the finish reasons it covers. "refused": the gateway answered with an error and no engine generated
# (400, 403, 404, 429, 503 ...: status_code and error_code say which); "error": an engine failed the request.
STATUSES = {"ok": ("stop", "length", ""), "aborted": ("abort",), "error": ("error",), "refused": (REFUSED,)}
MAX_LIMIT = 200


class BadCursor(ValueError):
    pass


@dataclass(frozen=True)
class LogFilters:
    key_prefix: str = ""
    adapter: str = ""  # an adapter's name; "-" for requests to a base model
    model: str = ""  # a base model's name
    status: str = ""  # "ok" | "aborted" | "error"
    since: datetime | None = None
    until: datetime | None = None
    tenant_slug: str = ""  # staff view only


@dataclass(frozen=True)
class LogPage:
    rows: list[UsageEvent]
    sort: str
    next_cursor: str | None


def request_status(event: UsageEvent) -> str:
    for status, reasons in STATUSES.items():
        if event.finish_reason in reasons:
            return status
    return "ok"


def request_log_filtered(*, tenant: Tenant | None, filters: LogFilters) -> QuerySet[UsageEvent]:
    """One tenant's requests (every tenant's with None, for staff), refusals included, narrowed by the filters."""
    events = UsageEvent.answered.all()
    if tenant is not None:
        events = events.filter(tenant=tenant)
    elif filters.tenant_slug:
        events = events.filter(tenant__slug=filters.tenant_slug)
    if filters.key_prefix:
        events = events.filter(api_key_prefix=filters.key_prefix)
    if filters.adapter == "-":
        events = events.filter(adapter_version__isnull=True)
    elif filters.adapter:
        events = events.filter(adapter_version__adapter__name=filters.adapter)
    if filters.model:
        events = events.filter(base_model=filters.model)
    if filters.status:
        events = events.filter(finish_reason__in=STATUSES[filters.status])
    if filters.since is not None:
        events = events.filter(finished_at__gte=filters.since)
    if filters.until is not None:
        events = events.filter(finished_at__lt=filters.until)
    return events


@dataclass(frozen=True)
class LogTotals:
    """Sums over every row the filters match, not just one page's."""

    counts: RequestCounts
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    price: Decimal


def request_log_totals(*, tenant: Tenant | None, filters: LogFilters) -> LogTotals:
    """How many requests the filters match (served and refused, counted as request_counts counts them) and their
    summed tokens and cost."""
    sums = request_log_filtered(tenant=tenant, filters=filters).order_by().aggregate(
        **request_count_aggregates(), prompt_tokens=Sum("prompt_tokens", default=0),
        cached_tokens=Sum("cached_tokens", default=0), completion_tokens=Sum("completion_tokens", default=0),
        price=Sum("price", default=Decimal(0)),
    )  # fmt: skip
    counts = RequestCounts(**{name: sums.pop(name) for name in ("served", "refused", "rate_limited")})
    return LogTotals(counts=counts, **sums)


def _encode(sort: str, value, row_id: int) -> str:
    if isinstance(value, datetime):
        value = value.isoformat()
    elif isinstance(value, Decimal):
        value = str(value)
    return base64.urlsafe_b64encode(json.dumps([sort, value, row_id]).encode()).decode().rstrip("=")


def _decode(cursor: str, sort: str):
    try:
        name, value, row_id = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if name != sort.lstrip("-") or not isinstance(row_id, int):
            raise ValueError
        if name == "time":
            value = datetime.fromisoformat(value)
        elif name == "cost":
            value = Decimal(value)
        elif not isinstance(value, int | float):
            raise ValueError
    except (ValueError, TypeError, binascii.Error, json.JSONDecodeError):
        raise BadCursor("This cursor is not one this list gave out, or belongs to another sort order.") from None
    return value, row_id


def request_log_page(
    *, tenant: Tenant | None, filters: LogFilters, sort: str = "-time", cursor: str = "", limit: int = 50
) -> LogPage:
    """One page of the log in `sort` order ("time", "-time", "latency", ...), after `cursor` when given."""
    name, descending = sort.lstrip("-"), sort.startswith("-")
    if name not in SORTS:
        raise ValueError(f"sort must be one of {', '.join(sorted(SORTS))}, optionally with a leading '-'")
    limit = max(1, min(limit, MAX_LIMIT))
    events = request_log_filtered(tenant=tenant, filters=filters).annotate(sort_value=SORTS[name])
    if cursor:
        value, row_id = _decode(cursor, sort)
        after = Q(sort_value__lt=value) | Q(sort_value=value, id__lt=row_id) if descending else \
            Q(sort_value__gt=value) | Q(sort_value=value, id__gt=row_id)  # fmt: skip
        events = events.filter(after)
    order = ["-sort_value", "-id"] if descending else ["sort_value", "id"]
    rows = list(
        events.select_related("tenant", "api_key", "adapter_version__adapter").order_by(*order)[: limit + 1]
    )
    more = len(rows) > limit
    rows = rows[:limit]
    for row in rows:
        row.status = request_status(row)
    next_cursor = _encode(name, rows[-1].sort_value, rows[-1].id) if more else None
    return LogPage(rows=rows, sort=sort, next_cursor=next_cursor)


BODIES_ROLE = Membership.Role.DEVELOPER  # prompts and completions: developers and above, and staff; never viewers


def bodies_readable(*, reader: Actor, tenant: Tenant | None) -> bool:
    """Whether `reader` may read the prompts and completions `tenant` keeps (an anonymous refusal keeps none)."""
    if tenant is None:
        return False
    role = actor_role(actor=reader, tenant=tenant)
    return role is not None and role_at_least(role, BODIES_ROLE)


def request_detail(
    *, tenant: Tenant | None, request_id: str, reader: Actor
) -> tuple[UsageEvent, RequestBody | None] | None:
    """One request (of `tenant`; any tenant's for staff) and its stored bodies, if its tenant keeps them and
    `reader` may read them (bodies_readable)."""
    events = UsageEvent.answered.select_related("tenant", "api_key", "adapter_version__adapter")
    if tenant is not None:
        events = events.filter(tenant=tenant)
    event = events.filter(request_id=request_id).first()
    if event is None:
        return None
    event.status = request_status(event)
    body = None
    if bodies_readable(reader=reader, tenant=event.tenant):
        body = RequestBody.objects.filter(request_id=request_id, tenant_id=event.tenant_id).first()
    return event, body
