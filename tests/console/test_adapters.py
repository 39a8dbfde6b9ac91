"""Adapters in the console: uploads (XHR and plain), validation results in words, promote, roll back, delete."""

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse
from django.utils.html import escape

from registry.models import Adapter, AdapterVersion
from registry.services import adapter_create, adapter_version_create
from registry.validation import adapter_version_validate
from tenancy.audit import Actor
from tests.console.builders import BASE_NAME

pytestmark = pytest.mark.django_db
XHR = {"HTTP_X_REQUESTED_WITH": "XMLHttpRequest"}


def url(view: str, tenant, **kwargs) -> str:
    return reverse(f"console:{view}", kwargs={"slug": tenant.slug, **kwargs})


def zip_file(data: bytes, name: str = "adapter.zip") -> SimpleUploadedFile:
    return SimpleUploadedFile(name, data, content_type="application/zip")


@pytest.fixture
def ready_adapter(tenant, base_model, adapter_zips):
    """support-bot with v1 (current) and v2, both validated by the real validation service."""
    adapter = adapter_create(actor=Actor.system(), tenant=tenant, name="support-bot", base_model=BASE_NAME,
                             files=[zip_file(adapter_zips[0])], enqueue=False)  # fmt: skip
    adapter_version_validate(version_id=adapter.versions.get(number=1).pk)
    second = adapter_version_create(actor=Actor.system(), adapter=adapter, files=[zip_file(adapter_zips[1])],
                                    enqueue=False)  # fmt: skip
    adapter_version_validate(version_id=second.pk)
    return adapter


def test_an_xhr_upload_answers_where_to_go_next(tenant, member_of, base_model, adapter_zips, django_capture_on_commit_callbacks):
    client, _ = member_of(tenant, "developer")
    form = {"name": "support-bot", "base_model": BASE_NAME, "file": zip_file(adapter_zips[0])}
    with django_capture_on_commit_callbacks(execute=False):
        response = client.post(url("adapter-upload", tenant), form, **XHR)
    assert response.status_code == 200
    assert response.json() == {"redirect": url("adapter", tenant, name="support-bot"), "version": 1}
    assert AdapterVersion.objects.get(adapter__name="support-bot").status == "uploaded"


def test_a_refused_upload_says_why(tenant, member_of, base_model):
    client, _ = member_of(tenant, "developer")
    empty = client.post(url("adapter-upload", tenant), {"name": "x", "base_model": BASE_NAME,
                                                        "file": zip_file(b"", "empty.zip")}, **XHR)  # fmt: skip
    assert empty.status_code == 400 and empty.json() == {"errors": ["The uploaded file is empty."]}
    nameless = client.post(url("adapter-upload", tenant), {"base_model": BASE_NAME, "file": zip_file(b"zz")})
    assert nameless.status_code == 400 and b"Name the new adapter" in nameless.content
    assert not Adapter.objects.exists()


def test_a_failed_validation_shows_its_reason(tenant, member_of, base_model, tmp_path):
    from tests.tiny_llama import save_peft_adapter, zipped

    client, _ = member_of(tenant, "viewer")
    too_wide = zipped(save_peft_adapter(tmp_path / "wide", seed=3, hidden_size=48))
    adapter = adapter_create(actor=Actor.system(), tenant=tenant, name="broken", base_model=BASE_NAME,
                             files=[zip_file(too_wide, "broken.zip")], enqueue=False)  # fmt: skip
    version = adapter_version_validate(version_id=adapter.versions.get().pk)
    assert version.status == "failed"
    page = client.get(url("adapter", tenant, name="broken")).content.decode()
    assert 'data-status="failed"' in page and escape(version.failure_message) in page


def test_promote_roll_back_and_delete(tenant, member_of, ready_adapter):
    client, _ = member_of(tenant, "developer")
    detail = client.get(url("adapter", tenant, name="support-bot")).content.decode()
    assert 'data-testid="promote-2"' in detail and "data-confirm=" in detail
    response = client.post(url("adapter-promote", tenant, name="support-bot"), {"version": "2"}, follow=True)
    assert b"now serves version 2" in response.content
    assert Adapter.objects.get(pk=ready_adapter.pk).current_version.number == 2
    client.post(url("adapter-rollback", tenant, name="support-bot"))
    assert Adapter.objects.get(pk=ready_adapter.pk).current_version.number == 1
    refused = client.post(url("adapter-delete", tenant, name="support-bot"), {"confirm_name": "oops"}, follow=True)
    assert b"to confirm the deletion" in refused.content
    client.post(url("adapter-delete", tenant, name="support-bot"), {"confirm_name": "support-bot"})
    assert Adapter.objects.get(pk=ready_adapter.pk).deleted_at is not None
    assert client.get(url("adapter", tenant, name="support-bot")).status_code == 404


def test_viewers_read_adapters_but_change_nothing(tenant, member_of, ready_adapter):
    client, _ = member_of(tenant, "viewer")
    page = client.get(url("adapter", tenant, name="support-bot")).content.decode()
    assert "promote-2" not in page and "Delete adapter" not in page
    assert client.get(url("adapter-upload", tenant)).status_code == 403
    assert client.post(url("adapter-promote", tenant, name="support-bot"), {"version": "2"}).status_code == 403
    assert client.post(url("adapter-delete", tenant, name="support-bot"), {"confirm_name": "support-bot"}).status_code == 403
    assert Adapter.objects.get(pk=ready_adapter.pk).current_version.number == 1


def test_adapters_of_another_tenant_are_not_found(tenant, other_tenant, member_of, ready_adapter):
    client, _ = member_of(other_tenant, "owner")
    assert client.get(url("adapter", other_tenant, name="support-bot")).status_code == 404
    assert client.post(url("adapter-promote", other_tenant, name="support-bot"), {"version": "2"}).status_code == 404


def test_the_adapter_list_pages_in_a_fixed_number_of_queries(
    tenant, member_of, base_model, django_assert_max_num_queries
):
    client, _ = member_of(tenant, "viewer")
    for index in range(30):
        adapter = Adapter.objects.create(tenant=tenant, name=f"a-{index:02d}", base_model=base_model)
        for number in (1, 2):
            AdapterVersion.objects.create(adapter=adapter, number=number, status="ready" if number == 1 else "failed")
    with django_assert_max_num_queries(10):
        response = client.get(url("adapters", tenant) + "?sort=-name")
    rows = response.context["adapters"].rows
    assert [row.name for row in rows][:2] == ["a-29", "a-28"]
    assert (rows[0].version_count, rows[0].latest_number, rows[0].latest_status) == (2, 2, "failed")
