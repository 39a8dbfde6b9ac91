"""Budget alerts at 80% and 100% of a tenant's monthly token budget and spend limit, once per month each.

The BudgetAlert row's unique constraint makes each (tenant, month, kind, threshold) happen once; its row lock
serializes delivery. Email goes out once; a webhook that failed is retried (the task raises WebhookFailed).

Admission never lets usage pass a limit: it refuses a request whose estimate would, so usage stops short of 100%.
The 100% alert is therefore also due when admission refuses a request on that limit (`exhausted`). An alert
recorded against another limit than today's (the budget changed) is refreshed with today's figures and delivered
again if its threshold is still reached, else removed, so that it fires again when it is.
"""

import hashlib
import hmac
import json
import logging
from datetime import date
from decimal import Decimal

import httpx
from django.core.mail import send_mail
from django.db import transaction
from django.utils import timezone

from billing.models import BudgetAlert
from metering.selectors import usage_totals_month
from tenancy.models import Membership, Tenant
from tenancy.webhook_targets import webhook_post

logger = logging.getLogger(__name__)

THRESHOLDS = (80, 100)
SIGNATURE_HEADER = "X-Quilt-Signature"
WEBHOOK_TIMEOUT_SECONDS = 5.0


class WebhookFailed(Exception):
    pass


def webhook_signature(*, secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def _used_and_limits(*, tenant: Tenant, month: date) -> dict[str, tuple[Decimal, Decimal | None]]:
    totals = usage_totals_month(tenant=tenant, month=month)
    budget, spend = tenant.plan.monthly_token_budget, tenant.plan.monthly_spend_limit
    return {
        BudgetAlert.Kind.TOKENS: (Decimal(totals.total_tokens), Decimal(budget) if budget is not None else None),
        BudgetAlert.Kind.SPEND: (totals.price, Decimal(spend) if spend is not None else None),
    }


def _reached(
    *, figures: dict[str, tuple[Decimal, Decimal | None]], exhausted: str | None
) -> list[tuple[str, int, Decimal, Decimal]]:
    return [
        (kind, threshold, used, limit)
        for kind, (used, limit) in figures.items()
        if limit  # no limit (None), or a zero limit that admission refuses outright
        for threshold in THRESHOLDS
        if used * 100 >= limit * threshold or (threshold == 100 and kind == exhausted)
    ]


def _refresh_changed(*, tenant: Tenant, month: date, figures: dict[str, tuple[Decimal, Decimal | None]]) -> None:
    """Alerts recorded against a limit that has since changed: refreshed and due again if still reached (at
    100% only when usage reaches it), else removed (re-armed)."""
    for alert in BudgetAlert.objects.filter(tenant=tenant, month=month):
        used, limit = figures[alert.kind]
        if limit == alert.limit:
            continue
        if limit and used * 100 >= limit * alert.threshold:
            alert.used, alert.limit, alert.emailed_at, alert.webhook_sent_at = used, limit, None, None
            alert.save(update_fields=["used", "limit", "emailed_at", "webhook_sent_at"])
        else:
            alert.delete()


def _recipients(tenant: Tenant) -> list[str]:
    if tenant.billing_email:
        return [tenant.billing_email]
    owners = Membership.objects.filter(tenant=tenant, role=Membership.Role.OWNER).select_related("user")
    return sorted({membership.user.email for membership in owners if membership.user.email})


def _describe(alert: BudgetAlert) -> str:
    what = "monthly token budget" if alert.kind == BudgetAlert.Kind.TOKENS else "monthly spend limit"
    return f"{alert.tenant.name} has used {alert.threshold}% of its {what} for {alert.month:%Y-%m}"


def _email(alert: BudgetAlert) -> None:
    recipients = _recipients(alert.tenant)
    if recipients:
        send_mail(
            subject=f"[Quilt] {_describe(alert)}",
            message=f"{_describe(alert)}: {alert.used.normalize():f} of {alert.limit.normalize():f}.",
            from_email=None,
            recipient_list=recipients,
        )


def _post_webhook(alert: BudgetAlert) -> None:
    tenant = alert.tenant
    body = json.dumps({
        "type": "budget.threshold_reached", "tenant": tenant.slug, "month": f"{alert.month:%Y-%m}",
        "kind": alert.kind, "threshold": alert.threshold, "used": f"{alert.used.normalize():f}",
        "limit": f"{alert.limit.normalize():f}", "created_at": alert.created_at.isoformat(),
    }).encode()  # fmt: skip
    headers = {"Content-Type": "application/json", SIGNATURE_HEADER: webhook_signature(secret=tenant.webhook_secret,
                                                                                        body=body)}  # fmt: skip
    # public addresses only, checked after DNS resolution, and the connection goes to the address checked (security)
    response = webhook_post(tenant.webhook_url, content=body, headers=headers, timeout=WEBHOOK_TIMEOUT_SECONDS)
    response.raise_for_status()


def budget_alerts_check(*, tenant: Tenant, month: date, exhausted: str | None = None) -> list[BudgetAlert]:
    """Records and delivers each threshold the month's usage has reached, and the 100% alert of the `exhausted`
    limit (admission refused a request on it); returns the alerts it touched."""
    month = month.replace(day=1)
    touched, failures = [], []
    figures = _used_and_limits(tenant=tenant, month=month)
    _refresh_changed(tenant=tenant, month=month, figures=figures)
    for kind, threshold, used, limit in _reached(figures=figures, exhausted=exhausted):
        with transaction.atomic():
            BudgetAlert.objects.bulk_create(
                [
                    BudgetAlert(
                        tenant=tenant, month=month, kind=kind, threshold=threshold, used=used, limit=limit
                    )
                ],
                ignore_conflicts=True,
            )
            alert = (
                BudgetAlert.objects.select_for_update()
                .select_related("tenant")
                .get(tenant=tenant, month=month, kind=kind, threshold=threshold)
            )
            wants_webhook = bool(tenant.webhook_url)
            if alert.emailed_at is not None and (alert.webhook_sent_at is not None or not wants_webhook):
                continue
            if alert.emailed_at is None:
                _email(alert)
                alert.emailed_at = timezone.now()
            if wants_webhook and alert.webhook_sent_at is None:
                if not tenant.webhook_secret:
                    alert.webhook_error = "The tenant has a webhook URL but no webhook secret to sign with."
                    logger.warning("budget alert %s: %s", alert, alert.webhook_error)
                else:
                    try:
                        _post_webhook(alert)
                        alert.webhook_sent_at, alert.webhook_error = timezone.now(), ""
                    except httpx.HTTPError as error:
                        alert.webhook_error = f"{type(error).__name__}: {error}"[:2000]
                        failures.append(alert)
            alert.save(update_fields=["emailed_at", "webhook_sent_at", "webhook_error"])
            touched.append(alert)
    if failures:
        raise WebhookFailed("; ".join(f"{alert}: {alert.webhook_error}" for alert in failures))
    return touched
