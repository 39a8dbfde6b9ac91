"""A tiny random Llama checkpoint, PEFT adapters made for it by PEFT itself, and upload helpers."""

import json
import time
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from registry.base_models import base_model_register
from registry.models import AdapterVersion
from tenancy.audit import Actor
from tests.platform.conftest import key_client, member_client, tenant_a, tenant_b  # noqa: F401
from tests.tiny_llama import save_peft_adapter, save_tiny_base, zipped

BASE_NAME = "tiny-llama"


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory) -> Path:
    return save_tiny_base(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def adapter_zip(tmp_path_factory) -> bytes:
    """A valid PEFT LoRA (rank 4 on q, v and down) for the tiny base, zipped."""
    return zipped(save_peft_adapter(tmp_path_factory.mktemp("peft-good"), seed=1))


@pytest.fixture(scope="session")
def other_adapter_zip(tmp_path_factory) -> bytes:
    return zipped(save_peft_adapter(tmp_path_factory.mktemp("peft-other"), seed=2, rank=2))


@pytest.fixture(scope="session")
def third_adapter_zip(tmp_path_factory) -> bytes:
    return zipped(save_peft_adapter(tmp_path_factory.mktemp("peft-third"), seed=4))


@pytest.fixture(scope="session")
def wrong_base_zip(tmp_path_factory) -> bytes:
    """Made by PEFT for a wider model (hidden 48): its shapes cannot fit the tiny base."""
    return zipped(save_peft_adapter(tmp_path_factory.mktemp("peft-wrong"), seed=3, hidden_size=48))


@pytest.fixture
def media_root(settings, tmp_path) -> Path:
    settings.MEDIA_ROOT = tmp_path / "media"
    return settings.MEDIA_ROOT


@pytest.fixture
def base_model(db, tiny_base_dir, media_root):
    return base_model_register(actor=Actor.system(), name=BASE_NAME, checkpoint_dir=tiny_base_dir)


def upload(name: str, data: bytes) -> SimpleUploadedFile:
    return SimpleUploadedFile(name, data, content_type="application/octet-stream")


def create_adapter(client, name: str, data: bytes, *, filename: str = "adapter.zip", **extra):
    body = {"name": name, "base_model": BASE_NAME, "file": upload(filename, data), **extra}
    return client.post("/api/v1/adapters", body, format="multipart")


def files_under(root: Path) -> list[str]:
    if not root.exists():
        return []
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())


def wait_for_status(version_id: int, statuses: tuple[str, ...], *, timeout: float = 60.0) -> AdapterVersion:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        version = AdapterVersion.objects.get(pk=version_id)
        if version.status in statuses:
            return version
        time.sleep(0.1)
    raise AssertionError(f"version {version_id} stayed {version.status}, waited for {statuses}")


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def ready_version(client, name: str, data: bytes) -> AdapterVersion:
    """Uploads through the API (a new adapter, or its next version) and validates in this process."""
    from registry.validation import adapter_version_validate

    if client.get(f"/api/v1/adapters/{name}").status_code == 404:
        response = create_adapter(client, name, data)
        number = 1
    else:
        response = client.post(f"/api/v1/adapters/{name}/versions", {"file": upload("v.zip", data)},
                               format="multipart")  # fmt: skip
        number = response.json()["number"]
    assert response.status_code == 201, response.content
    version = AdapterVersion.objects.get(adapter__name=name, adapter__deleted_at__isnull=True, number=number)
    return adapter_version_validate(version_id=version.pk)


@pytest.fixture(scope="session", autouse=True)
def _drop_the_runs_queue():
    """Tests that commit enqueue validations no worker takes; drop this run's queue from Redis at the end."""
    yield
    from django.conf import settings

    from quilt.celery import app

    with app.connection_for_write() as conn:
        conn.default_channel.queue_delete(settings.CELERY_TASK_DEFAULT_QUEUE)
