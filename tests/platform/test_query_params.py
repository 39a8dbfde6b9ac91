"""Query parameters of the management API's lists and filters: a malformed, out-of-range or unknown value is a 400
in the API's error shape that names the parameter, never a 500 and never a silent default."""

import pytest
from rest_framework.test import APIClient

from tests.platform.factories import MembershipFactory, TenantFactory, UserFactory, make_key

pytestmark = pytest.mark.django_db

MODEL_BACKEND = "django.contrib.auth.backends.ModelBackend"
TENANT_LISTS = ["/api/v1/keys", "/api/v1/members", "/api/v1/invitations", "/api/v1/adapters", "/api/v1/invoices",
                "/api/v1/tenant/audit"]  # fmt: skip
STAFF_LISTS = ["/api/v1/tenants", "/api/v1/plans", "/api/v1/audit"]


@pytest.fixture
def clients(tenant_a):
    MembershipFactory(tenant=tenant_a, role="owner")
    _, plaintext = make_key(tenant_a)
    tenant = APIClient()
    tenant.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    staff = APIClient()
    staff.force_login(UserFactory(is_staff=True), backend=MODEL_BACKEND)
    return {"tenant": tenant, "staff": staff}


def _client_for(clients, path):
    return clients["staff"] if path in STAFF_LISTS else clients["tenant"]


def _refused(response, param: str) -> None:
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and param in error["message"], error


@pytest.mark.parametrize("path", TENANT_LISTS + STAFF_LISTS)
@pytest.mark.parametrize(("query", "param"), [
    ("limit=201", "limit"), ("limit=100000", "limit"), ("limit=99999999999999999999999", "limit"),
    ("limit=0", "limit"), ("limit=-1", "limit"), ("limit=1.5", "limit"), ("limit=", "limit"),
    ("limit=%D9%A3", "limit"), ("offset=-1", "offset"), ("offset=x", "offset"), ("offset=", "offset"),
])  # fmt: skip
def test_a_bad_page_is_400(clients, path, query, param):
    _refused(_client_for(clients, path).get(f"{path}?{query}"), param)


@pytest.mark.parametrize("path", TENANT_LISTS + STAFF_LISTS)
def test_the_largest_page_is_fine(clients, path):
    response = _client_for(clients, path).get(f"{path}?limit=200&offset=0")
    assert response.status_code == 200 and "results" in response.json()


def test_tenants_by_an_unknown_status_is_400(clients):
    TenantFactory(slug="paused", status="suspended")
    _refused(clients["staff"].get("/api/v1/tenants?status=bogus"), "status")
    _refused(clients["staff"].get("/api/v1/tenants?status=SUSPENDED"), "status")
    suspended = clients["staff"].get("/api/v1/tenants?status=suspended").json()["results"]
    assert [row["slug"] for row in suspended] == ["paused"]


@pytest.mark.parametrize("month", ["", "2026-13", "2026-1", "%D9%A2%D9%A0%D9%A2%D9%A6-10", "0000-01", "2026-10-01"])
def test_a_bad_margin_month_is_400(clients, month):
    _refused(clients["staff"].get(f"/api/v1/reports/margin?month={month}"), "month")


def test_a_misspelt_margin_parameter_is_400(clients):
    _refused(clients["staff"].get("/api/v1/reports/margin?month=2026-10&montth=2026-11"), "montth")


@pytest.mark.parametrize(("who", "url"), [
    ("tenant", "/api/v1/tenant/audit?action=%00"),
    ("tenant", "/api/v1/tenant/audit?actor=a%00b"),
    ("tenant", "/api/v1/keys/%00"),
    ("tenant", "/api/v1/keys/ab%00cd/revoke"),
    ("tenant", "/api/v1/adapters/%00"),
    ("tenant", "/api/v1/adapters/a%00/versions"),
    ("tenant", "/api/v1/invitations/%00"),
    ("tenant", "/api/v1/usage?start=%00"),
    ("staff", "/api/v1/tenants?search=%00"),
    ("staff", "/api/v1/audit?tenant=%00"),
    ("staff", "/api/v1/audit?%00=1"),
])  # fmt: skip
def test_a_nul_character_in_the_url_is_400(clients, who, url):
    response = clients[who].get(url)
    assert response.status_code == 400, response.content
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", TENANT_LISTS + STAFF_LISTS)
def test_a_parameter_a_list_does_not_take_is_400(clients, path):
    """?page=2 or ?sort=name would otherwise be ignored: the caller gets a first page and thinks it is what they
    asked for."""
    _refused(_client_for(clients, path).get(f"{path}?page=2"), "page")
    assert _client_for(clients, path).get(f"{path}?limit=5&offset=0&format=json").status_code == 200


@pytest.mark.parametrize(("path", "query"), [
    ("/api/v1/tenant/audit", "action=api_key.&actor=someone"), ("/api/v1/tenants", "search=a&status=active"),
    ("/api/v1/audit", "tenant=tenant-a&action=tenant.&actor=someone"),
])  # fmt: skip
def test_the_filters_a_list_takes_are_fine(clients, path, query):
    assert _client_for(clients, path).get(f"{path}?{query}").status_code == 200


@pytest.mark.parametrize(("path", "query", "param"), [
    ("/api/v1/tenant/audit", "action=" + "a" * 65, "action"), ("/api/v1/tenant/audit", "actor=" + "a" * 151, "actor"),
    ("/api/v1/audit", "tenant=not%20a%20slug", "tenant"),
])  # fmt: skip
def test_a_malformed_audit_filter_is_400(clients, path, query, param):
    _refused(_client_for(clients, path).get(f"{path}?{query}"), param)


def test_the_list_filters_are_in_the_schema(clients):
    schema = clients["staff"].get("/api/schema/?format=json").json()
    names = {path: {p["name"] for p in schema["paths"][path]["get"].get("parameters", [])}
             for path in ("/api/v1/tenant/audit", "/api/v1/audit", "/api/v1/tenants")}  # fmt: skip
    assert {"action", "actor", "limit", "offset"} <= names["/api/v1/tenant/audit"]
    assert {"tenant", "action", "actor"} <= names["/api/v1/audit"] and {"search", "status"} <= names["/api/v1/tenants"]


@pytest.mark.parametrize("path", ["/api/v1/usage", "/api/v1/invoices", "/api/v1/keys", "/api/v1/tenant"])
@pytest.mark.parametrize("fmt", ["xml", "CSV", ""])
def test_an_unknown_format_is_400(clients, path, fmt):
    _refused(clients["tenant"].get(f"{path}?format={fmt}"), "format")


def test_the_formats_an_api_renders_are_fine(clients):
    assert clients["tenant"].get("/api/v1/usage?format=csv")["Content-Type"].startswith("text/csv")
    assert clients["tenant"].get("/api/v1/keys?format=json").status_code == 200
    assert clients["tenant"].get("/api/v1/usage.csv").status_code == 200
