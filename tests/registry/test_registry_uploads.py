"""Uploads answer at once with an `uploaded` version; caps by plan and platform refuse with nothing stored."""

import pytest

from registry.models import Adapter, AdapterVersion
from tenancy.models import AuditLog, Plan
from tests.platform.factories import TenantFactory
from tests.registry.conftest import BASE_NAME, create_adapter, files_under, upload

pytestmark = pytest.mark.django_db


def test_upload_creates_the_adapter_with_version_one_uploaded(tenant_a, member_client, base_model, adapter_zip,
                                                              media_root):  # fmt: skip
    client, membership = member_client(tenant_a, "developer")
    response = create_adapter(client, "support-bot", adapter_zip, description="tickets")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["name"] == "support-bot" and body["base_model"] == BASE_NAME and body["current_version"] is None
    assert body["version"]["number"] == 1 and body["version"]["status"] == "uploaded"
    assert body["version"]["upload_bytes"] == len(adapter_zip)
    version = AdapterVersion.objects.get(adapter__tenant=tenant_a, adapter__name="support-bot")
    assert version.created_by == membership.user
    stored = files_under(media_root)
    assert stored == [f"{version.upload_key}/adapter.zip"]
    assert (media_root / stored[0]).read_bytes() == adapter_zip


def test_loose_files_can_be_uploaded_as_several_parts(tenant_a, key_client, base_model, tmp_path, media_root):
    from tests.tiny_llama import save_peft_adapter

    folder = save_peft_adapter(tmp_path / "peft", seed=5)
    client, _, _ = key_client(tenant_a, scopes=["adapters:write"])
    parts = [upload(path.name, path.read_bytes()) for path in sorted(folder.iterdir())]
    response = client.post("/api/v1/adapters", {"name": "loose", "base_model": BASE_NAME, "file": parts},
                           format="multipart")  # fmt: skip
    assert response.status_code == 201, response.content
    key = AdapterVersion.objects.get(adapter__name="loose").upload_key
    assert {name.rsplit("/", 1)[1] for name in files_under(media_root)} >= {
        "adapter_config.json", "adapter_model.safetensors"
    } and all(name.startswith(key) for name in files_under(media_root))


def test_the_eleventh_adapter_is_refused_on_the_starter_plan(tenant_a, key_client, base_model, adapter_zip,
                                                             media_root):  # fmt: skip
    assert tenant_a.plan.slug == "starter" and tenant_a.plan.max_adapters == 10
    for index in range(10):
        Adapter.objects.create(tenant=tenant_a, name=f"a{index}", base_model=base_model)
    client, _, _ = key_client(tenant_a, scopes=["adapters:write"])
    audits = AuditLog.objects.count()
    response = create_adapter(client, "one-too-many", adapter_zip)
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["code"] == "adapter_limit_reached" and "allows 10 adapters" in error["message"]
    assert not Adapter.objects.filter(name="one-too-many").exists()
    assert files_under(media_root) == [] and AuditLog.objects.count() == audits
    Adapter.objects.filter(name="a0").update(deleted_at="2026-01-01T00:00:00Z")
    assert create_adapter(client, "one-too-many", adapter_zip).status_code == 201


@pytest.mark.parametrize("padding", [4_000, 400_000], ids=["streamed-past-the-cap", "announced-past-the-cap"])
def test_a_file_over_the_plan_cap_is_refused_and_nothing_is_stored(key_client, base_model, media_root, padding):
    plan = Plan.objects.create(slug="small", name="Small", max_adapter_bytes=2_000)
    tenant = TenantFactory(plan=plan)
    client, _, _ = key_client(tenant, scopes=["adapters:write"])
    response = create_adapter(client, "big", b"x" * padding)
    assert response.status_code == 413, response.content
    error = response.json()["error"]
    assert error["code"] == "adapter_too_large" and "your plan (Small) allows at most 2.0 KiB" in error["message"]
    assert not Adapter.objects.exists() and files_under(media_root) == []
    assert not AuditLog.objects.filter(action__startswith="adapter").exists()


def test_the_platform_cap_applies_below_the_plan(settings, tenant_a, key_client, base_model, adapter_zip, media_root):
    settings.QUILT_MAX_UPLOAD_BYTES = len(adapter_zip) - 1
    client, _, _ = key_client(tenant_a, scopes=["adapters:write"])
    response = create_adapter(client, "big", adapter_zip)
    assert response.status_code == 413
    assert "this platform allows" in response.json()["error"]["message"]
    assert files_under(media_root) == []


def test_a_browser_session_upload_is_capped_before_its_csrf_check_reads_the_body(
    settings, tenant_a, base_model, adapter_zip, media_root
):
    from rest_framework.test import APIClient

    from tests.platform.factories import MembershipFactory

    settings.QUILT_MAX_UPLOAD_BYTES = len(adapter_zip) - 1
    browser = APIClient(enforce_csrf_checks=True)
    browser.force_login(MembershipFactory(tenant=tenant_a, role="developer").user,
                        backend="django.contrib.auth.backends.ModelBackend")  # fmt: skip
    browser.cookies[settings.CSRF_COOKIE_NAME] = "k" * 32  # so the check goes on to read the form's token
    response = create_adapter(browser, "big", adapter_zip)
    assert response.status_code == 413, response.content
    assert "this platform allows at most" in response.json()["error"]["message"]
    assert files_under(media_root) == [] and not Adapter.objects.exists()


def test_bad_requests_are_refused_clearly(tenant_a, key_client, base_model, adapter_zip, media_root):
    client, _, _ = key_client(tenant_a, scopes=["adapters:write"])
    cases = [
        ({"name": "x", "base_model": "no-such-base", "file": upload("a.zip", adapter_zip)}, 422, "unknown_base_model"),
        ({"name": "bad@name", "base_model": BASE_NAME, "file": upload("a.zip", adapter_zip)}, 400, "invalid_name"),
        ({"name": BASE_NAME, "base_model": BASE_NAME, "file": upload("a.zip", adapter_zip)}, 409, "adapter_exists"),
        ({"name": "x", "base_model": BASE_NAME, "file": upload("a.zip", b"")}, 422, "file_empty"),
        ({"name": "x", "base_model": BASE_NAME}, 400, "file: This field is required"),
    ]
    for body, status, code in cases:
        response = client.post("/api/v1/adapters", body, format="multipart")
        assert response.status_code == status, (body, response.content)
        error = response.json()["error"]
        assert code == error["code"] or code in error["message"], response.content
    assert create_adapter(client, "dup", adapter_zip).status_code == 201
    response = create_adapter(client, "dup", adapter_zip)
    assert response.status_code == 409 and response.json()["error"]["code"] == "adapter_exists"
    assert Adapter.objects.count() == 1 and len(files_under(media_root)) == 1


def test_new_versions_count_up(tenant_a, key_client, base_model, adapter_zip, other_adapter_zip, third_adapter_zip,
                               media_root):  # fmt: skip
    client, _, _ = key_client(tenant_a, scopes=["adapters:write"])
    create_adapter(client, "bot", adapter_zip)
    for number, data in ((2, other_adapter_zip), (3, third_adapter_zip)):
        response = client.post("/api/v1/adapters/bot/versions", {"file": upload("v.zip", data)}, format="multipart")
        assert response.status_code == 201, response.content
        assert response.json()["number"] == number and response.json()["status"] == "uploaded"
    stored = files_under(media_root)
    again = client.post("/api/v1/adapters/bot/versions", {"file": upload("again.zip", other_adapter_zip)},
                        format="multipart")  # fmt: skip
    assert again.status_code == 409, again.content
    error = again.json()["error"]
    assert error["code"] == "identical_upload" and "identical to version 2 of bot" in error["message"]
    assert files_under(media_root) == stored
    listed = client.get("/api/v1/adapters/bot/versions").json()
    assert [v["number"] for v in listed] == [1, 2, 3]
    assert client.post("/api/v1/adapters/nope/versions", {"file": upload("v.zip", adapter_zip)},
                       format="multipart").status_code == 404  # fmt: skip


def test_scopes_and_roles(tenant_a, key_client, member_client, base_model, adapter_zip, media_root):
    inference_key, _, _ = key_client(tenant_a, scopes=["inference"])
    assert inference_key.get("/api/v1/adapters").status_code == 200
    assert inference_key.get("/api/v1/base-models").json()[0]["name"] == BASE_NAME
    response = create_adapter(inference_key, "x", adapter_zip)
    assert response.status_code == 403 and response.json()["error"]["code"] == "insufficient_scope"
    viewer, _ = member_client(tenant_a, "viewer")
    assert viewer.get("/api/v1/adapters").status_code == 200
    assert create_adapter(viewer, "x", adapter_zip).status_code == 403
    developer, _ = member_client(tenant_a, "developer")
    assert create_adapter(developer, "x", adapter_zip).status_code == 201
    assert inference_key.delete("/api/v1/adapters/x").status_code == 403
    assert viewer.post("/api/v1/adapters/x/promote", {"version": 1}, format="json").status_code == 403
    from rest_framework.test import APIClient

    assert APIClient().get("/api/v1/adapters").status_code in (401, 403)


def test_uploads_stream_to_temporary_files_and_stop_at_the_cap():
    from django.core.files.uploadedfile import TemporaryUploadedFile
    from django.test import RequestFactory

    from registry.errors import UploadTooLarge
    from registry.upload_handlers import CappedTemporaryFileUploadHandler

    def parsed(size: int, cap: int):
        request = RequestFactory().post("/", {"file": upload("a.zip", b"z" * size)})
        refusal = UploadTooLarge("too large", code="adapter_too_large")
        request.upload_handlers = [CappedTemporaryFileUploadHandler(request, cap=cap, refusal=refusal)]
        return request.FILES["file"]

    small = parsed(10, cap=100)
    assert isinstance(small, TemporaryUploadedFile), "even a tiny upload goes to disk, never to memory"
    assert open(small.temporary_file_path(), "rb").read() == b"z" * 10
    with pytest.raises(UploadTooLarge):
        parsed(101, cap=100)
