"""The gateway's own reports to the request log (gateway.request_reports): refusals become rows of their own, and
the gateway's status and times are written onto the rows of the requests engines served.

A refusal's row is a UsageEvent with finish_reason "refused", its status and error code, its key, no tokens and no
price: `UsageEvent.objects` (what usage, billing and economics count) never sees it. A refusal before a key let the
request in (a 401, a 413 read before the key) has no tenant: an anonymous row, in the staff's log only, with the
prefix of the key it presented. Written once per request id
(ON CONFLICT DO NOTHING), like the engines' events, so a replayed batch changes nothing.

The gateway's times replace ttft_ms/e2e_ms (the engine's stay in engine_ttft_ms/engine_e2e_ms). A report can
arrive before the engine's event (both travel through the broker): those come back unmatched, and the task tries
them again a little later.
"""

import logging
from dataclasses import dataclass
from decimal import Decimal

from django.db import transaction
from django.utils.dateparse import parse_datetime

from apikeys.models import ApiKey
from metering.models import REFUSED, UsageEvent
from metering.signals import requests_logged
from registry.models import AdapterVersion
from tenancy.models import Tenant

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReportsResult:
    refusals: int  # refusal rows offered (one already there is left as it is)
    answered: int  # served rows given the gateway's status and times
    unmatched: list[dict]  # timing reports whose row is not there yet


def _refusal_rows(reports: list[dict]) -> list[UsageEvent]:
    tenants = Tenant.objects.in_bulk({report["tenant_id"] for report in reports if report["tenant_id"] is not None})
    keys = ApiKey.objects.in_bulk({report["api_key_id"] for report in reports if report.get("api_key_id")})
    versions = set(AdapterVersion.objects.filter(
        pk__in={report["adapter_version_id"] for report in reports if report.get("adapter_version_id")}
    ).values_list("pk", "adapter__tenant_id"))  # fmt: skip
    rows = []
    for report in reports:
        tenant = tenants.get(report["tenant_id"])
        if tenant is None and report["tenant_id"] is not None:
            logger.error("refusal %s names an unknown tenant %r; dropped", report["request_id"], report["tenant_id"])
            continue
        tenant_id = tenant.pk if tenant is not None else None
        key = keys.get(report.get("api_key_id"))
        version = report.get("adapter_version_id")
        finished_at = parse_datetime(report["finished_at"])
        rows.append(UsageEvent(
            request_id=report["request_id"][:100], tenant=tenant, api_key=key if key and key.tenant_id == tenant_id
            else None, api_key_prefix=(report.get("key_prefix") or "")[:16], model=str(report.get("model") or "")[:250],
            base_model=str(report.get("base_model") or "")[:200],
            adapter_version_id=version if (version, tenant_id) in versions else None, prompt_tokens=0,
            completion_tokens=0, finish_reason=REFUSED, status_code=report["status_code"],
            error_code=str(report.get("error_code") or "")[:64], error=str(report.get("error") or "")[:500],
            price_input_per_mtok=Decimal(0), price_cached_input_per_mtok=Decimal(0), price_output_per_mtok=Decimal(0),
            price=Decimal(0), finished_at=finished_at,
        ))  # fmt: skip
    return rows


def gateway_reports_record(*, reports: list[dict]) -> ReportsResult:
    refusals = [report for report in reports if report.get("kind") == "refused"]
    timings = {report["request_id"]: report for report in reports if report.get("kind") == "answered"}
    with transaction.atomic():
        written = UsageEvent.answered.bulk_create(_refusal_rows(refusals), ignore_conflicts=True)
        served = {
            row.request_id: row for row in
            UsageEvent.objects.select_for_update().filter(request_id__in=list(timings)).order_by("request_id")
        }  # fmt: skip
        for request_id, row in served.items():
            report = timings[request_id]
            row.status_code = report["status_code"]
            row.ttft_ms = report["ttft_ms"]
            row.e2e_ms = report["e2e_ms"]
        UsageEvent.objects.bulk_update(list(served.values()), ["status_code", "ttft_ms", "e2e_ms"])
    logged = {row.tenant_id for row in written} - {None}
    if logged:
        requests_logged.send(sender=UsageEvent, tenant_ids=logged)
    unmatched = [report for request_id, report in timings.items() if request_id not in served]
    return ReportsResult(refusals=len(written), answered=len(served), unmatched=unmatched)
