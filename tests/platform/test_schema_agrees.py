"""The management API takes what its OpenAPI schema allows and refuses what it does not: a field's
own pattern is the schema's, no request string may hold a NUL, a body is JSON of the declared types, and a refusal for
an object's state is a 409, not a 400 that reads as "your request was malformed"."""

import re
import sys

import jsonschema_rs
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.validators import slug_re
from drf_spectacular.generators import SchemaGenerator
from rest_framework import serializers
from rest_framework.test import APIClient

from quilt.schema import NOT_BLANK
from registry.models import model_name_validator
from tenancy.models import Membership
from tenancy.serializers import WEBHOOK_SECRET, WEBHOOK_URL
from tests.platform.factories import MembershipFactory, UserFactory, make_key

pytestmark = pytest.mark.django_db


@pytest.fixture
def schema(client):
    return client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()


@pytest.fixture
def staff(tenant_a):
    client = APIClient()
    user = MembershipFactory(tenant=tenant_a, role="owner", user=UserFactory(is_staff=True)).user
    client.force_login(user, backend="django.contrib.auth.backends.ModelBackend")
    return client


def _property(schema, component: str, name: str) -> dict:
    field = schema["components"]["schemas"][component]["properties"][name]
    return field.get("oneOf", [field])[0]  # a field that may be blank: "" is the oneOf's other branch


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.content
    return response.json()["error"]


def _ecma(pattern: str) -> str:
    return pattern.replace(r"\Z", "$").replace(r"\A", "^")


@pytest.mark.parametrize(("component", "name", "pattern"), [
    ("TenantCreateInput", "slug", slug_re.pattern),
    ("PlanInput", "slug", slug_re.pattern),
    ("InvitationAcceptInput", "username", r"^[\w.@+-]+\Z"),
    ("WebhookSecretInput", "secret", WEBHOOK_SECRET),
    ("AdapterCreateInput", "name", model_name_validator.regex.pattern),
    ("PatchedTenantSettingsInput", "webhook_url", WEBHOOK_URL),
])  # fmt: skip
def test_a_fields_own_pattern_is_the_one_the_schema_gives(schema, component, name, pattern):
    assert _property(schema, component, name)["pattern"] == _ecma(pattern)


def test_no_string_in_a_request_body_may_hold_a_nul(schema):
    checked = 0
    for component, body in schema["components"]["schemas"].items():
        if not component.endswith("Input"):
            continue
        for name in body.get("properties", {}):
            field = _property(schema, component, name)
            field = field.get("items", field)
            if field.get("type") == "string" and "enum" not in field and "format" not in field:
                assert "pattern" in field, (component, name)
                assert not re.search(field["pattern"], "ab\x00cd" * 6), (component, name)
                checked += 1
    assert checked > 15


def test_an_adapter_name_the_registry_refuses_is_one_the_schema_refuses(schema, tenant_a, key_client):
    client = key_client(tenant_a, scopes=["adapters:write"])[0]
    assert not re.search(_property(schema, "AdapterCreateInput", "name")["pattern"], "Ⱥ-bot")
    body = {"name": "Ⱥ-bot", "base_model": "x", "file": SimpleUploadedFile("a.zip", b"PK")}
    response = client.post("/api/v1/adapters", body, format="multipart")
    assert _error(response, 400)["code"] == "invalid_name"


def test_only_the_uploads_take_a_form_the_rest_json_alone(schema):
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            if path.startswith("/api/v1/") and "requestBody" in operation:
                upload = path in ("/api/v1/adapters", "/api/v1/adapters/{name}/versions") and method == "post"
                expected = ["multipart/form-data"] if upload else ["application/json"]
                assert list(operation["requestBody"]["content"]) == expected, (method, path)


@pytest.mark.parametrize(("method", "path", "body", "message"), [
    ("post", "/api/v1/keys", {"name": 5, "scopes": ["inference"]}, "name: Must be a string."),
    ("post", "/api/v1/keys", {"name": "k", "scopes": ["inference"], "allowed_models": [1]}, "allowed_models: Must"),
    ("post", "/api/v1/keys/{key}/rotate", {"grace_seconds": "60"}, "grace_seconds: Must be an integer."),
    ("put", "/api/v1/keys/{key}/limits", {"monthly_spend_limit": 5}, "monthly_spend_limit: Write the amount"),
    ("put", "/api/v1/keys/{key}/limits", {"monthly_spend_limit": ""}, "monthly_spend_limit: Write the amount"),
    ("put", "/api/v1/keys/{key}/limits", {"monthly_spend_limit": " 5"}, "monthly_spend_limit: Write the amount"),
    ("put", "/api/v1/keys/{key}/limits", {"monthly_spend_limit": "-0"}, "monthly_spend_limit: Ensure"),
    ("post", "/api/v1/plans", {"slug": "p", "name": "P", "price_input_per_mtok": 0.2}, "price_input_per_mtok: Write"),
    ("post", "/api/v1/tenants", {"slug": "t", "name": "T", "plan": 5}, "plan: Must be a plan's slug"),
])  # fmt: skip
def test_a_value_of_another_json_type_than_the_schemas_is_400(tenant_a, staff, method, path, body, message):
    key, _ = make_key(tenant_a, scopes=["inference"])
    response = getattr(staff, method)(path.format(key=key.prefix), body, format="json")
    assert _error(response, 400)["message"].startswith(message)


def test_an_objects_state_is_409(tenant_a, staff):
    key, _ = make_key(tenant_a, scopes=["inference"])
    assert staff.post(f"/api/v1/keys/{key.prefix}/revoke").status_code == 200
    assert _error(staff.post(f"/api/v1/keys/{key.prefix}/rotate", {}, format="json"), 409)["code"] == "conflict"
    assert staff.post("/api/v1/plans", {"slug": "twice", "name": "Twice"}, format="json").status_code == 201
    assert _error(staff.post("/api/v1/plans", {"slug": "twice", "name": "Again"}, format="json"), 409)["code"] == \
        "conflict"


def test_a_patch_of_nothing_changes_nothing(tenant_a, staff):
    member = MembershipFactory(tenant=tenant_a, role="viewer")
    response = staff.patch(f"/api/v1/members/{member.pk}", {}, format="json")
    assert response.status_code == 200 and response.json()["role"] == "viewer"
    assert Membership.objects.get(pk=member.pk).role == "viewer"


def test_a_format_beside_a_csv_suffix_is_400_and_not_in_the_schema(schema, tenant_a, key_client):
    client = key_client(tenant_a)[0]
    assert _error(client.get("/api/v1/requests.csv?format="), 400)["message"].startswith("format:")
    assert _error(client.get("/api/v1/usage.csv?format=json"), 400)["message"].startswith("format:")
    for path in ("/api/v1/requests.csv", "/api/v1/usage.csv", "/api/v1/invoices/{invoice_id}.csv"):
        assert "format" not in [parameter["name"] for parameter in schema["paths"][path]["get"]["parameters"]]


@pytest.mark.parametrize("query", ["/api/v1/audit?actor=", "/api/v1/audit?tenant=", "/api/v1/tenant/audit?action=",
                                   "/api/v1/tenants?status=", "/api/v1/tenants?search="])  # fmt: skip
def test_a_list_filter_given_blank_is_400_as_the_schemas_min_length_says(staff, query):
    assert _error(staff.get(query), 400)["code"] == "blank"


@pytest.mark.parametrize("url", ["https://hooks.example.a/q", "https://Hooks.example.com/q", "https://a.example.com/#^",
                                 "https://a.example.com/é", "https://a.example.com:65536/", "ftp://a.example.com/"])  # fmt: skip
def test_a_webhook_url_the_schema_refuses_the_api_refuses(tenant_a, staff, url):
    assert not re.search(WEBHOOK_URL, url)
    assert _error(staff.patch("/api/v1/tenant", {"webhook_url": url}, format="json"), 400)["message"].startswith(
        "webhook_url:")


def test_a_webhook_url_the_schema_allows_is_saved(tenant_a, staff):
    url = "https://hooks.example.com:8443/quilt/alerts?tenant=a%20b#budget"
    assert re.search(WEBHOOK_URL, url)
    response = staff.patch("/api/v1/tenant", {"webhook_url": url}, format="json")
    assert response.status_code == 200 and response.json()["webhook_url"] == url


@pytest.mark.parametrize("path", ["/api/v1/adapters", "/api/v1/adapters/{name}/versions"])
def test_the_uploads_document_a_file_that_is_not_an_adapter_as_422(schema, path):
    description = schema["paths"][path]["post"]["responses"]["422"]["description"]
    assert "not an adapter" in description and "pickle" in description


# Characters str.strip() removes that ECMAScript's \s (the schema's regex dialect) does not match, one that \s matches
# and strip() keeps, and plain white space: each alone is a value whose blankness the schema and the API must agree on.
EDGE_TEXT = ["\u001c", "\x1f", "\x85", "\ufeff", " ", "\u3000", "\x1c\x85 \x1f"]


def _ecma_allows(field_schema: dict, value: str) -> bool:
    """Whether the schema allows the value, as a JSON Schema validator with ECMAScript regexes reads it."""
    return jsonschema_rs.validator_for(field_schema, validate_formats=True).is_valid(value)


def _text_fields(schema: dict):
    for component, body in schema["components"]["schemas"].items():
        if not component.endswith("Input"):
            continue
        for name, field_schema in body.get("properties", {}).items():
            item = field_schema.get("items", field_schema)
            if any(branch.get("type") == "string" for branch in item.get("oneOf", [item])) \
                    and item.get("format") != "binary":
                yield component, name, item


def test_every_text_field_of_a_body_refuses_what_the_api_refuses_as_blank():
    generator = SchemaGenerator()
    schema = generator.get_schema(request=None, public=True)
    checked = 0
    for component, name, field_schema in _text_fields(schema):
        serializer = generator.registry[(component, "schemas")].object
        field = serializer.fields[name]
        field = getattr(field, "child", field)
        for value in EDGE_TEXT:
            try:
                field.run_validation(value)
                api_takes = True
            except serializers.ValidationError:
                api_takes = False
            assert _ecma_allows(field_schema, value) == api_takes, (component, name, value, api_takes)
            checked += 1
    assert checked > 20 * len(EDGE_TEXT)


def test_every_text_query_parameter_refuses_what_the_api_refuses_as_blank(schema, tenant_a, staff):
    checked = 0
    for path, operations in schema["paths"].items():
        get = operations.get("get")
        if not path.startswith("/api/") or get is None or "{" in path:
            continue
        for parameter in get.get("parameters", []):
            field_schema = parameter.get("schema") or {}
            if parameter["in"] != "query" or field_schema.get("type") != "string" or "format" in field_schema \
                    or "enum" in field_schema:
                continue
            for value in EDGE_TEXT:
                response = staff.get(path, {parameter["name"]: value})
                assert response.status_code in (200, 400, 404), (path, response.content)
                api_takes = response.status_code != 400  # a cursor it never gave out is a 404: read, not refused
                assert _ecma_allows(field_schema, value) == api_takes, (path, parameter["name"], value, api_takes)
                checked += 1
    assert checked > 5 * len(EDGE_TEXT)


def test_the_not_blank_pattern_names_exactly_what_str_strip_removes():
    blank = jsonschema_rs.validator_for({"type": "string", "pattern": NOT_BLANK})
    for point in range(sys.maxunicode + 1):
        character = chr(point)
        if point == 0 or 0xD800 <= point <= 0xDFFF:
            continue
        assert blank.is_valid(character) == (character.strip() != ""), hex(point)
