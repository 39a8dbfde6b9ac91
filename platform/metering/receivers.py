"""What metering does when other apps announce a fact."""

from django.dispatch import receiver

from metering.services import request_bodies_retention_apply
from tenancy.signals import body_retention_changed


@receiver(body_retention_changed, dispatch_uid="metering-apply-body-retention")
def _apply_body_retention(sender, *, tenant_id: int, days: int, **kwargs) -> None:
    request_bodies_retention_apply(tenant_id=tenant_id, days=days)
