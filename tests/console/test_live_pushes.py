"""What makes the tenant's pages live: metering recording requests and a fine-tuning job's events push one message
to the tenant's Channels group (the console's socket turns it into a refresh of the page's live regions)."""

import asyncio

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from finetuning.events import job_event
from finetuning.models import JobEvent
from metering.services import usage_ingest
from registry.broadcast import tenant_group
from registry.models import BaseModel
from tests.console.builders import usage_event
from tests.finetuning.test_console_page import _job
from tests.platform.factories import TenantFactory

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def listening(settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    layer = get_channel_layer()
    tenant = TenantFactory(slug="live")
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(tenant_group(tenant.pk), channel)

    async def receive_all():
        messages = []
        while True:
            try:
                messages.append(await asyncio.wait_for(layer.receive(channel), timeout=0.5))
            except TimeoutError:
                return messages

    return tenant, async_to_sync(receive_all)


def test_a_batch_of_recorded_usage_pushes_once_per_tenant(listening):
    tenant, received = listening
    other = TenantFactory(slug="elsewhere")
    usage_ingest(events=[usage_event(tenant) for _ in range(3)] + [usage_event(other)])
    assert received() == [{"type": "usage.recorded"}]


def test_a_training_step_pushes_progress(listening):
    tenant, received = listening
    base = BaseModel.objects.create(name="live-base", checkpoint_dir="/x", architecture="llama", config={},
                                    max_context=256)  # fmt: skip
    job = _job(tenant, base, status="running")
    job_event(job=job, kind=JobEvent.Kind.METRICS, message="Step 1/4", data={"step": 1, "train_loss": 2.0})
    assert received() == [{"type": "fine_tuning.progress"}]
