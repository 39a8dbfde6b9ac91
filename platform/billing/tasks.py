"""Thin tasks: budget alerts (sent on commit by usage ingest) and the monthly invoice run (beat)."""

from datetime import date

from celery import shared_task
from django.db import InterfaceError, OperationalError
from django.utils import timezone

from billing.alerts import WebhookFailed, budget_alerts_check
from billing.invoices import invoices_issue_month, previous_month
from tenancy.models import Tenant

TRANSIENT = (OperationalError, InterfaceError)


@shared_task(
    name="billing.check_budget_alerts", autoretry_for=(*TRANSIENT, WebhookFailed), retry_backoff=True,
    retry_backoff_max=600, max_retries=8,
)  # fmt: skip
def check_budget_alerts(tenant_id: int, month: str, exhausted: str | None = None) -> int:
    """`exhausted`: "tokens" or "spend" when admission refused a request on that limit (sent by the gateway)."""
    tenant = Tenant.objects.select_related("plan").get(pk=tenant_id)
    return len(budget_alerts_check(tenant=tenant, month=date.fromisoformat(month), exhausted=exhausted))


@shared_task(name="billing.issue_invoices", autoretry_for=TRANSIENT, retry_backoff=True, max_retries=5)
def issue_invoices(month: str | None = None) -> int:
    """Issues last month's invoices (or `month`'s, YYYY-MM-DD); running it again changes nothing."""
    billed = date.fromisoformat(month) if month else previous_month(timezone.now().date())
    return len(invoices_issue_month(month=billed))
