"""A tenant's pages, live: usage recorded (a request finished and metering wrote it) and a fine-tuning job's event
(a training step, a status change) tell the tenant's open pages (overview, usage, billing, requests, fine-tuning)
to re-fetch their live regions, through the channel layer (and the relay, in the demo). One push per tenant per
ingested batch, whatever its size."""

from django.db import transaction
from django.db.models.signals import post_save
from django.dispatch import receiver

from finetuning.models import JobEvent
from metering.signals import requests_logged, usage_recorded
from registry.broadcast import push, tenant_group

USAGE_MESSAGE = "usage.recorded"
FINE_TUNING_MESSAGE = "fine_tuning.progress"


@receiver(usage_recorded, dispatch_uid="console-usage-recorded")
def usage_recorded_push(sender, *, usages, **kwargs) -> None:
    for tenant_id in sorted({usage.tenant_id for usage in usages if usage.new}):
        push(tenant_group(tenant_id), {"type": USAGE_MESSAGE})


@receiver(requests_logged, dispatch_uid="console-requests-logged")
def requests_logged_push(sender, *, tenant_ids, **kwargs) -> None:
    """The gateway's refusals reached the log: the requests page and the usage charts show them."""
    for tenant_id in sorted(tenant_ids):
        push(tenant_group(tenant_id), {"type": USAGE_MESSAGE})


@receiver(post_save, sender=JobEvent, dispatch_uid="console-fine-tuning-progress")
def job_event_saved(sender, instance: JobEvent, created: bool, **kwargs) -> None:
    if created:
        group = tenant_group(instance.job.tenant_id)
        transaction.on_commit(lambda: push(group, {"type": FINE_TUNING_MESSAGE}), robust=True)
