"""Reactions to other apps' signals. Only enqueue: the work is in services, run by the worker."""

from django.db import transaction
from django.db.models.signals import post_save
from django.dispatch import receiver
from django.utils import timezone

from metering.signals import usage_recorded
from tenancy.models import Plan, Tenant


@receiver(usage_recorded, dispatch_uid="billing-check-alerts-on-usage")
def check_alerts_on_usage(sender, *, usages, **kwargs) -> None:
    from billing.tasks import check_budget_alerts

    for tenant_id, month in sorted({(u.tenant_id, u.month) for u in usages if u.new and u.budgeted}):
        transaction.on_commit(lambda t=tenant_id, m=month: check_budget_alerts.delay(t, m.isoformat()))


def _check_this_month(tenant_ids) -> None:
    from billing.tasks import check_budget_alerts

    month = timezone.now().date().replace(day=1).isoformat()
    for tenant_id in tenant_ids:
        transaction.on_commit(lambda t=tenant_id: check_budget_alerts.delay(t, month))


@receiver(post_save, sender=Plan, dispatch_uid="billing-refresh-alerts-on-plan")
def refresh_alerts_on_plan_change(sender, *, instance: Plan, created: bool, **kwargs) -> None:
    """A budget changed: this month's alerts of the plan's tenants are refreshed (see billing.alerts)."""
    if not created:
        _check_this_month(Tenant.objects.filter(plan=instance).values_list("pk", flat=True))


@receiver(post_save, sender=Tenant, dispatch_uid="billing-refresh-alerts-on-tenant")
def refresh_alerts_on_tenant_change(sender, *, instance: Tenant, created: bool, **kwargs) -> None:
    """The tenant may have moved to another plan, with other limits."""
    if not created:
        _check_this_month([instance.pk])
