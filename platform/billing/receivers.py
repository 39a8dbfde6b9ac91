"""Reactions to other apps' signals. Only enqueue: the work is in services, run by the worker."""

from django.db import transaction
from django.dispatch import receiver

from metering.signals import usage_recorded


@receiver(usage_recorded, dispatch_uid="billing-check-alerts-on-usage")
def check_alerts_on_usage(sender, *, usages, **kwargs) -> None:
    from billing.tasks import check_budget_alerts

    for tenant_id, month in sorted({(u.tenant_id, u.month) for u in usages if u.new and u.budgeted}):
        transaction.on_commit(lambda t=tenant_id, m=month: check_budget_alerts.delay(t, m.isoformat()))
