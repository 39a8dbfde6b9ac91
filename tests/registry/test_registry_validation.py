"""Validation in this process (the worker path is tested in test_registry_worker): ready, failed, shared blobs, GC."""

import os
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.utils import timezone

import adapters
from registry.garbage import adapter_blobs_collect
from registry.models import Adapter, AdapterVersion
from registry.storage import adapter_store_root, canonical_local_dir
from registry.validation import adapter_version_validate, adapter_versions_stale
from tenancy.models import AuditLog
from tests.registry.conftest import BASE_NAME, create_adapter, files_under, ready_version, upload

pytestmark = pytest.mark.django_db


@pytest.fixture
def writer(tenant_a, key_client):
    return key_client(tenant_a, scopes=["adapters:write"])[0]


def test_a_peft_adapter_becomes_ready_promoted_and_stored_in_canonical_form(
    writer, base_model, adapter_zip, media_root, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        version = ready_version(writer, "bot", adapter_zip)
    assert version.status == "ready" and version.failure_message == ""
    assert version.rank == 4 and version.alpha == 8.0 and version.target_modules == ["q_proj", "v_proj", "down_proj"]
    assert version.storage_key == f"adapters/{version.digest}" and version.validation_attempts == 1
    assert adapter_store_root() == media_root / "adapters"
    canonical = adapters.load_canonical(canonical_local_dir(digest=version.digest))
    assert canonical.digest == version.digest and canonical.num_bytes == version.num_bytes
    assert files_under(media_root / "adapter-uploads") == [], "the raw upload goes once validated"
    detail = writer.get("/api/v1/adapters/bot").json()
    assert detail["current_version"] == 1 and detail["versions"][0]["status"] == "ready"
    promote = AuditLog.objects.get(action="adapter.promote")
    assert promote.actor_user is None and promote.actor_key is None and promote.after["automatic"] is True


def test_a_broken_adapter_fails_with_a_readable_message(writer, base_model, wrong_base_zip, media_root):
    version = ready_version(writer, "wide", wrong_base_zip)
    assert version.status == "failed" and version.failure_code == "tensor_shape"
    assert "layer 0" in version.failure_message and "expected" in version.failure_message
    detail = writer.get("/api/v1/adapters/wide").json()
    assert detail["current_version"] is None
    assert detail["versions"][0]["failure_message"] == version.failure_message
    assert files_under(media_root / "adapters") == []


PNG = b"\x89PNG\r\n\x1a\n" + bytes(64)


def test_pickles_and_stray_files_are_refused_as_unprocessable_before_a_version_exists(writer, base_model, media_root):
    """Each body has the schema's shape (a name, a base model, a file): what is refused is the file's content, a 422."""
    cases = [
        ("adapter_model.bin", b"\x80\x04data", "pickle_file", "adapter_model.bin is a pickle file"),
        ("adapter.zip", bytes(range(256)) * 8, "archive_corrupt", "adapter.zip is not a readable zip archive"),
        ("adapter_config.json", b'{"r": 4}', "weights_missing", "adapter_config.json found but no adapter_model"),
        ("photo.png", PNG, "config_missing", "No adapter_config.json"),
        ("adapter.zip", b"", "file_empty", "The uploaded file is empty."),
    ]
    for filename, data, code, message in cases:
        response = create_adapter(writer, "refused", data, filename=filename)
        assert response.status_code == 422, response.content
        error = response.json()["error"]
        # file names keep their case: the tenant's "adapter.zip" is not "Adapter.zip"
        assert error["code"] == code and error["message"].startswith(message), error
        assert error["type"] == "invalid_request_error"
    twice = [upload("adapter_config.json", b'{"r": 4}'), upload("adapter_config.json", b'{"r": 4}')]
    body = {"name": "refused", "base_model": BASE_NAME, "file": twice}
    response = writer.post("/api/v1/adapters", body, format="multipart")
    assert response.status_code == 422 and response.json()["error"]["code"] == "duplicate_file", response.content
    assert not AdapterVersion.objects.exists() and files_under(media_root) == []


def test_a_new_version_whose_content_is_not_an_adapter_is_422(writer, base_model, adapter_zip, media_root):
    assert create_adapter(writer, "bot", adapter_zip).status_code == 201
    response = writer.post("/api/v1/adapters/bot/versions", {"file": upload("photo.png", PNG)}, format="multipart")
    assert response.status_code == 422 and response.json()["error"]["code"] == "config_missing", response.content
    assert AdapterVersion.objects.filter(adapter__name="bot").count() == 1


def test_identical_uploads_share_the_blob_but_not_the_metadata(writer, base_model, adapter_zip, media_root):
    first = ready_version(writer, "one", adapter_zip)
    second = ready_version(writer, "two", adapter_zip)
    assert first.pk != second.pk and second.adapter.name == "two"
    assert first.digest == second.digest and first.storage_key == second.storage_key
    repeat = writer.post("/api/v1/adapters/one/versions", {"file": upload("v.zip", adapter_zip)}, format="multipart")
    assert repeat.status_code == 409 and repeat.json()["error"]["code"] == "identical_upload"
    assert AdapterVersion.objects.filter(adapter__name="one").count() == 1
    assert sorted(p.name for p in (media_root / "adapters").iterdir()) == [first.digest]


def test_validation_is_idempotent(writer, base_model, adapter_zip, media_root):
    version = ready_version(writer, "bot", adapter_zip)
    again = adapter_version_validate(version_id=version.pk)
    assert (again.status, again.validation_attempts, again.validated_at) == (
        "ready", 1, version.validated_at
    )  # fmt: skip
    assert AuditLog.objects.filter(action="adapter.promote").count() == 1


def test_a_version_that_keeps_crashing_fails_instead_of_sticking(settings, writer, base_model, adapter_zip, media_root):
    response = create_adapter(writer, "bot", adapter_zip)
    assert response.status_code == 201
    version = AdapterVersion.objects.get(adapter__name="bot")
    long_ago = timezone.now() - timedelta(hours=1)
    AdapterVersion.objects.filter(pk=version.pk).update(
        status="validating", validation_attempts=settings.QUILT_ADAPTER_VALIDATION_MAX_ATTEMPTS,
        validation_started_at=long_ago,
    )  # fmt: skip
    assert list(adapter_versions_stale(older_than=timedelta(minutes=10))) == [version]
    failed = adapter_version_validate(version_id=version.pk)
    assert failed.status == "failed" and failed.failure_code == "validation_interrupted"
    assert "interrupted 3 times" in failed.failure_message
    assert list(adapter_versions_stale(older_than=timedelta(minutes=10))) == []


def test_status_changes_reach_the_tenants_channel_group_on_commit(
    tenant_a, writer, base_model, adapter_zip, media_root, django_capture_on_commit_callbacks
):
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(f"tenant-{tenant_a.id}", channel)
    with django_capture_on_commit_callbacks(execute=False):
        create_adapter(writer, "bot", adapter_zip)
    version = AdapterVersion.objects.get(adapter__name="bot")
    with django_capture_on_commit_callbacks(execute=True):
        adapter_version_validate(version_id=version.pk)
    received = [async_to_sync(layer.receive)(channel) for _ in range(2)]
    assert received == [
        {"type": "adapter.status", "adapter": "bot", "version": 1, "status": status, "message": ""}
        for status in ("validating", "ready")
    ]


def test_gc_removes_blobs_only_once_unreferenced(
    writer, base_model, adapter_zip, other_adapter_zip, media_root, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        shared = ready_version(writer, "one", adapter_zip)
        ready_version(writer, "two", adapter_zip)
        other = ready_version(writer, "three", other_adapter_zip)
    orphan = media_root / "adapter-uploads" / "deadbeef"
    orphan.mkdir(parents=True)
    (orphan / "adapter.zip").write_bytes(b"left behind by a crash")
    assert adapter_blobs_collect(grace=timedelta(hours=1)) == {"canonical": [], "uploads": []}
    assert writer.delete("/api/v1/adapters/one").status_code == 204
    assert adapter_blobs_collect(grace=timedelta(0)) == {"canonical": [], "uploads": ["adapter-uploads/deadbeef"]}
    assert writer.delete("/api/v1/adapters/two").status_code == 204
    assert adapter_blobs_collect(grace=timedelta(0)) == {"canonical": [shared.digest], "uploads": []}
    assert sorted(p.name for p in (media_root / "adapters").iterdir()) == [other.digest]
    assert not orphan.exists()


def test_an_upload_waiting_for_validation_is_not_collected(writer, base_model, adapter_zip, media_root):
    create_adapter(writer, "bot", adapter_zip)
    assert adapter_blobs_collect(grace=timedelta(0))["uploads"] == []
    version = adapter_version_validate(version_id=AdapterVersion.objects.get(adapter__name="bot").pk)
    assert version.status == "ready"


def test_a_new_version_of_a_deleted_adapter_is_not_validated(writer, base_model, adapter_zip, media_root):
    create_adapter(writer, "bot", adapter_zip)
    version = AdapterVersion.objects.get(adapter__name="bot")
    writer.delete("/api/v1/adapters/bot")
    assert adapter_version_validate(version_id=version.pk).failure_code == "adapter_deleted"


def test_a_remote_storage_works_through_the_same_api(settings, tmp_path, writer, base_model, adapter_zip,
                                                      media_root):  # fmt: skip
    """Not the filesystem (as with S3): uploads are fetched to validate, canonical forms mirrored for engines."""
    settings.STORAGES = {**settings.STORAGES, "default": {"BACKEND": "django.core.files.storage.InMemoryStorage"}}
    settings.QUILT_ADAPTER_CACHE_DIR = tmp_path / "mirror"
    first = ready_version(writer, "one", adapter_zip)
    second = ready_version(writer, "two", adapter_zip)
    assert first.status == second.status == "ready" and first.storage_key == second.storage_key
    assert files_under(media_root) == [], "nothing went to the filesystem storage"
    assert adapter_store_root() == tmp_path / "mirror"
    local = canonical_local_dir(digest=first.digest)
    assert local == tmp_path / "mirror" / first.digest
    assert adapters.load_canonical(local).digest == first.digest
    for name in ("one", "two"):
        writer.delete(f"/api/v1/adapters/{name}")
    removed = adapter_blobs_collect(grace=timedelta(0))
    assert removed["canonical"] == [first.digest] and len(removed["uploads"]) == 2


def test_gc_grace_covers_recent_deletions_and_reuse(writer, base_model, adapter_zip, media_root):
    version = ready_version(writer, "bot", adapter_zip)
    blob = media_root / "adapters" / version.digest
    two_hours_ago = (timezone.now() - timedelta(hours=2)).timestamp()
    for path in blob.iterdir():
        os.utime(path, (two_hours_ago, two_hours_ago))
    writer.delete("/api/v1/adapters/bot")
    assert adapter_blobs_collect(grace=timedelta(hours=1))["canonical"] == [], "engines may still be serving it"
    Adapter.objects.filter(name="bot").update(deleted_at=timezone.now() - timedelta(hours=2))
    reused = ready_version(writer, "again", adapter_zip)
    assert reused.digest == version.digest
    assert adapter_blobs_collect(grace=timedelta(hours=1))["canonical"] == [], "sharing it made it fresh again"
    writer.delete("/api/v1/adapters/again")
    Adapter.objects.filter(name="again").update(deleted_at=timezone.now() - timedelta(hours=2))
    for path in blob.iterdir():
        os.utime(path, (two_hours_ago, two_hours_ago))
    assert adapter_blobs_collect(grace=timedelta(hours=1))["canonical"] == [version.digest]
    assert not blob.exists()


def test_an_upload_gone_from_storage_fails_with_a_message(writer, base_model, adapter_zip, media_root):
    create_adapter(writer, "bot", adapter_zip)
    version = AdapterVersion.objects.get(adapter__name="bot")
    for path in (media_root / version.upload_key).iterdir():
        path.unlink()
    failed = adapter_version_validate(version_id=version.pk)
    assert (failed.status, failed.failure_code) == ("failed", "upload_missing")
    assert failed.failure_message == "The uploaded files are no longer stored; upload again."


def test_a_rank_past_the_platforms_limit_fails_with_a_readable_message(settings, writer, base_model, adapter_zip,
                                                                        media_root):  # fmt: skip
    settings.QUILT_ADAPTER_MAX_RANK = 2
    version = ready_version(writer, "wide-rank", adapter_zip)  # rank 4
    assert version.status == "failed" and version.failure_code == "rank_too_large"
    assert "rank 4" in version.failure_message and "up to 2" in version.failure_message
    assert writer.get("/api/v1/adapters/wide-rank").json()["current_version"] is None
