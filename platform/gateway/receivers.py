"""Reactions to other apps' signals. Only enqueue: the work is in services, run by the worker."""

from django.dispatch import receiver

from registry.signals import adapter_version_promoted
from registry.storage import adapter_store_root


@receiver(adapter_version_promoted, dispatch_uid="gateway-prefetch-successor")
def prefetch_on_promotion(sender, *, adapter, version, previous_version=None, **kwargs) -> None:
    from gateway.tasks import prefetch_successor

    if previous_version is None or not version.digest:
        return
    prefetch_successor.delay(previous_version.digest, version.digest, str(adapter_store_root() / version.digest))
