"""End to end with a real Celery worker over Redis on the test database: uploads through the API are validated
by the worker; a worker killed mid-validation leaves the version retryable, and the retry completes it."""

import pytest
from django.conf import settings

from quilt.celery import app
from registry.models import Adapter, AdapterVersion
from registry.tasks import requeue_stale_validations
from tests.conftest import start_worker, stop_worker
from tests.registry.conftest import create_adapter, files_under, wait_for_status

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def worker_over_media(media_root):
    """Started after MEDIA_ROOT points at this test's folder, so the worker stores blobs there too."""
    workers = []
    with app.connection_for_write() as conn:  # validations other tests committed and no worker took
        conn.default_channel.queue_purge(settings.CELERY_TASK_DEFAULT_QUEUE)

    def start(include=()):
        workers.append(start_worker(include=include))
        return workers[-1]

    yield start
    for worker in workers:
        if worker.poll() is None:
            stop_worker(worker)


def test_uploads_reach_ready_or_failed_in_the_worker(
    tenant_a, key_client, base_model, adapter_zip, wrong_base_zip, media_root, worker_over_media
):
    worker_over_media()
    client = key_client(tenant_a, scopes=["adapters:write"])[0]
    good = create_adapter(client, "bot", adapter_zip)
    bad = create_adapter(client, "wide", wrong_base_zip)
    assert good.json()["version"]["status"] == bad.json()["version"]["status"] == "uploaded"
    ready = wait_for_status(AdapterVersion.objects.get(adapter__name="bot").pk, ("ready", "failed"))
    failed = wait_for_status(AdapterVersion.objects.get(adapter__name="wide").pk, ("ready", "failed"))
    assert ready.status == "ready", ready.failure_message
    detail = client.get("/api/v1/adapters/bot").json()
    assert detail["current_version"] == 1 and detail["versions"][0]["digest"] == ready.digest
    assert (media_root / "adapters" / ready.digest / "quilt_adapter.json").is_file()
    assert failed.status == "failed" and failed.failure_code == "tensor_shape"
    message = client.get("/api/v1/adapters/wide").json()["versions"][0]["failure_message"]
    assert message == failed.failure_message and "expected" in message
    assert files_under(media_root / "adapter-uploads") == []


def test_a_worker_killed_mid_validation_leaves_the_version_retryable(
    settings, tenant_a, key_client, base_model, adapter_zip, media_root, worker_over_media
):
    stalling = worker_over_media(include=("tests.registry.worker_hooks",))
    client = key_client(tenant_a, scopes=["adapters:write"])[0]
    assert create_adapter(client, "bot", adapter_zip).status_code == 201
    version_id = AdapterVersion.objects.get(adapter__name="bot").pk
    claimed = wait_for_status(version_id, ("validating",))
    stalling.kill()
    stalling.wait()
    version = AdapterVersion.objects.get(pk=version_id)
    assert (version.status, version.validation_attempts, version.digest) == ("validating", 1, "")
    assert version.validation_started_at == claimed.validation_started_at
    settings.QUILT_ADAPTER_VALIDATION_LEASE_SECONDS = 0
    assert requeue_stale_validations() == [version_id]
    worker_over_media()
    version = wait_for_status(version_id, ("ready", "failed"))
    assert version.status == "ready" and version.validation_attempts == 2
    assert Adapter.objects.get(name="bot").current_version == version
