"""The request log as CSV: one column set for the console's Export CSV and the API's `requests.csv`, every row the
filters match (not one page), streamed as the database hands them over, so an export of a million rows holds a
few thousand in memory at a time.

`until` has one meaning wherever the log, the usage API and the console take it: a day (YYYY-MM-DD) is included
whole (until=2026-11-02 takes the requests of Nov 2), an instant (ISO 8601 with a time) is exclusive. `since` is
the start of its day, or its instant, included.
"""

import csv
from collections.abc import Iterator
from datetime import UTC, date, datetime, time, timedelta

from metering.models import UsageEvent
from metering.request_log import SORTS, LogFilters, request_log_filtered, request_status
from tenancy.models import Tenant

COLUMNS = [
    "request_id", "finished_at", "tenant", "api_key", "model", "base_model", "adapter", "adapter_version", "status",
    "status_code", "finish_reason", "error_code", "prompt_tokens", "cached_tokens", "completion_tokens", "image_count",
    "image_tokens", "ttft_ms", "e2e_ms", "engine_ttft_ms", "engine_e2e_ms", "queue_ms", "cost", "error",
]  # fmt: skip
CHUNK_ROWS = 2000


def since_instant(value: date | datetime | None) -> datetime | None:
    """`since` as the first instant it includes."""
    if value is None or isinstance(value, datetime):
        return value
    return datetime.combine(value, time.min, tzinfo=UTC)


def until_instant(value: date | datetime | None) -> datetime | None:
    """`until` as the first instant it excludes: a day's end (the next midnight, UTC), or the instant itself."""
    if value is None or isinstance(value, datetime):
        return value
    return datetime.combine(value + timedelta(days=1), time.min, tzinfo=UTC)


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def csv_row(event: UsageEvent) -> list:
    version = event.adapter_version
    return [
        event.request_id, event.finished_at.isoformat(), event.tenant.slug if event.tenant is not None else "",
        event.api_key_prefix, event.model, event.base_model, version.adapter.name if version else "",
        version.number if version else "",
        request_status(event), event.status_code or "", event.finish_reason, event.error_code, event.prompt_tokens,
        event.cached_tokens, event.completion_tokens, event.image_count, event.image_tokens, _ms(event.ttft_ms), _ms(event.e2e_ms), _ms(event.engine_ttft_ms),
        _ms(event.engine_e2e_ms), _ms(event.queue_ms), event.price, event.error,
    ]  # fmt: skip


class _Line:
    def write(self, value: str) -> str:
        return value


def request_log_csv(*, tenant: Tenant | None, filters: LogFilters, sort: str = "-time") -> Iterator[str]:
    """The header, then every matching row in `sort` order, one CSV line at a time."""
    name, descending = sort.lstrip("-"), sort.startswith("-")
    order = ["-sort_value", "-id"] if descending else ["sort_value", "id"]
    rows = (
        request_log_filtered(tenant=tenant, filters=filters).annotate(sort_value=SORTS[name])
        .select_related("tenant", "adapter_version__adapter").order_by(*order)
    )  # fmt: skip
    writer = csv.writer(_Line(), lineterminator="\n")
    yield writer.writerow(COLUMNS)
    for event in rows.iterator(chunk_size=CHUNK_ROWS):
        yield writer.writerow(csv_row(event))
