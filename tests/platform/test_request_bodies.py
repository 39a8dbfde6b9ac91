"""Hostile request bodies to the management API: each is refused in the API's error shape, never a 500 or an HTML
page."""

import pytest
from django.conf import settings
from django.test import Client
from django.urls import reverse

pytestmark = pytest.mark.django_db


@pytest.fixture
def client(tenant_a, key_client):
    return key_client(tenant_a)[0]


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/json"), response.content[:200]
    return response.json()["error"]


@pytest.mark.parametrize("body", [
    "[" * 100_000 + "]" * 100_000,
    '{"name": "a", "scopes": ' + "[" * 5_000 + "]" * 5_000 + "}",
    '{"a": ' * 5_000 + "1" + "}" * 5_000,
], ids=["deep-list", "deep-field", "deep-object"])  # fmt: skip
@pytest.mark.parametrize("path", ["/api/v1/keys", "/api/v1/adapters", "/api/v1/members"])
def test_json_nested_past_what_the_parser_can_walk_is_400(client, path, body):
    error = _error(client.post(path, data=body, content_type="application/json"), 400)
    assert error["type"] == "invalid_request_error" and "nested" in error["message"]


def test_a_body_past_the_size_limit_is_413_in_the_error_shape(client):
    name = "x" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1)
    error = _error(client.post("/api/v1/keys", data=f'{{"name": "{name}"}}', content_type="application/json"), 413)
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"


def test_a_form_with_too_many_fields_is_400_in_the_error_shape(client):
    fields = {f"f{i}": "1" for i in range(settings.DATA_UPLOAD_MAX_NUMBER_FIELDS + 1)}
    error = _error(client.post("/api/v1/adapters", data=fields, format="multipart"), 400)
    assert error["type"] == "invalid_request_error"


def test_a_form_to_an_operation_that_takes_json_is_415_as_the_schema_says(client):
    """The schema lists application/json alone for every body but the adapter uploads (multipart)."""
    error = _error(client.post("/api/v1/keys", data="name=k&scopes=inference",
                               content_type="application/x-www-form-urlencoded"), 415)  # fmt: skip
    assert error["code"] == "unsupported_media_type"


def test_a_page_outside_the_apis_keeps_its_html_400():
    response = Client().post(reverse("console:login"), data="&".join(f"f{i}=1" for i in range(5_000)),
                             content_type="application/x-www-form-urlencoded")  # fmt: skip
    assert response.status_code == 400 and not response["Content-Type"].startswith("application/json")


@pytest.mark.parametrize("plan", ["a\x00b", "not a slug", "x" * 500])
def test_a_plan_that_can_not_be_a_slug_is_400(plan):
    from rest_framework.test import APIClient

    from tests.platform.factories import TenantFactory, UserFactory

    TenantFactory(slug="acme")
    staff = APIClient()
    staff.force_login(UserFactory(is_staff=True), backend="django.contrib.auth.backends.ModelBackend")
    created = staff.post("/api/v1/tenants", {"slug": "newco", "name": "N", "plan": plan}, format="json")
    assert "plan" in _error(created, 400)["message"]
    changed = staff.patch("/api/v1/tenants/acme", {"plan": plan}, format="json")
    assert "plan" in _error(changed, 400)["message"]
