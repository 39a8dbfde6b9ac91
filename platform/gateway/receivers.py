"""Reactions to other apps' signals: enqueue work, or settle a hold (a Redis call or a short transaction)."""

from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from apikeys.auth_changes import auth_changed
from gateway.admission import hold_settle
from metering.models import ModelPrice
from metering.signals import usage_recorded
from registry.models import Adapter, AdapterVersion, BaseModel
from registry.signals import adapter_version_promoted, adapter_warm_changed
from registry.storage import adapter_store_root

# What the gateway's caller cache holds besides credentials (gateway.caller): resolved models (a promotion moves an
# adapter's name to another version) and the plan's per-model prices. Their changes are announced on the same
# channel as the credentials', and clear the cache in every gateway process once committed.
for _model in (BaseModel, Adapter, AdapterVersion, ModelPrice):
    post_save.connect(auth_changed, sender=_model, dispatch_uid=f"gateway-cache-save-{_model.__name__}")
    post_delete.connect(auth_changed, sender=_model, dispatch_uid=f"gateway-cache-delete-{_model.__name__}")


@receiver(adapter_version_promoted, dispatch_uid="gateway-prefetch-successor")
def prefetch_on_promotion(sender, *, adapter, version, previous_version=None, **kwargs) -> None:
    from gateway.tasks import prefetch_successor

    if previous_version is None or not version.digest:
        return
    prefetch_successor.delay(previous_version.digest, version.digest, str(adapter_store_root() / version.digest))


@receiver(adapter_warm_changed, dispatch_uid="gateway-sync-pins")
def sync_pins_on_warm_change(sender, *, adapter, **kwargs) -> None:
    from gateway.tasks import sync_pins

    sync_pins.delay()


@receiver(usage_recorded, dispatch_uid="gateway-settle-recorded-usage")
def settle_recorded_usage(sender, *, usages, **kwargs) -> None:
    """The engine's counts, now recorded, settle each request's hold finally (replacing a provisional settle)."""
    for usage in usages:
        hold_settle(
            tenant_id=usage.tenant_id, request_id=usage.request_id, tokens=usage.tokens, spend=usage.price,
            key_prefix=usage.api_key_lineage or usage.api_key_prefix or "",
        )  # fmt: skip
