"""Django admin pages for the registry render, and versions can't be edited there (they are immutable)."""

import pytest
from django.test import Client

from registry.models import AdapterVersion
from tests.platform.factories import UserFactory
from tests.registry.conftest import ready_version

pytestmark = pytest.mark.django_db


def test_admin_lists_and_shows_registry_rows(tenant_a, key_client, base_model, adapter_zip, media_root):
    version = ready_version(key_client(tenant_a, scopes=["adapters:write"])[0], "bot", adapter_zip)
    client = Client()
    client.force_login(UserFactory(is_staff=True, is_superuser=True), backend="django.contrib.auth.backends.ModelBackend")
    for model in ("basemodel", "adapter", "adapterversion", "adapterpromotion"):
        assert client.get(f"/admin/registry/{model}/").status_code == 200, model
    assert client.get(f"/admin/registry/adapter/{version.adapter_id}/change/").status_code == 200
    page = client.get(f"/admin/registry/adapterversion/{version.pk}/change/")
    assert page.status_code == 200 and b'name="status"' not in page.content
    client.post(f"/admin/registry/adapterversion/{version.pk}/change/", {"status": "failed"})
    assert AdapterVersion.objects.get(pk=version.pk).status == "ready"
