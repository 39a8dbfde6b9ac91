"""Hostile query values, path segments and body fields against the management API (/api/v1), with a tenant key, an
owner's session and a staff session: each answer is a 4xx or 2xx in the API's error shape, never a 5xx. (Schemathesis
covers what the OpenAPI schema documents; this covers the values it doesn't generate, like a NUL in a slug.)"""

import itertools

import pytest
from rest_framework.test import APIClient

from tests.platform.factories import MembershipFactory, TenantFactory, UserFactory, make_key

pytestmark = pytest.mark.django_db

QUERY_VALUES = [
    "", " ", "%00", "%FF", "%ED%A0%80", "-1", "0", "1e999", "99999999999999999999999", "a" * 5000, "%D9%A3", "[]",
    "null", "../../etc", "%0A", "2026-02-29", "9999-12-31", "0000-00-00",
]  # fmt: skip
QUERIES = {
    "/api/v1/usage": ["start", "end", "group_by", "format"],
    "/api/v1/usage.csv": ["start", "end", "group_by"],
    "/api/v1/invoices": ["limit", "offset"],
    "/api/v1/keys": ["limit", "offset"],
    "/api/v1/members": ["limit", "offset"],
    "/api/v1/invitations": ["limit", "offset"],
    "/api/v1/adapters": ["limit", "offset"],
    "/api/v1/tenant/audit": ["action", "actor", "limit"],
    "/api/v1/tenants": ["search", "status", "limit"],
    "/api/v1/plans": ["limit"],
    "/api/v1/audit": ["tenant", "action", "actor"],
    "/api/v1/reports/margin": ["month"],
}
STAFF_PATHS = ("/api/v1/tenants", "/api/v1/plans", "/api/v1/audit", "/api/v1/reports/margin")
SEGMENTS = [
    ("get", "/api/v1/keys/{}"), ("post", "/api/v1/keys/{}/revoke"), ("get", "/api/v1/adapters/{}"),
    ("get", "/api/v1/adapters/{}/versions"), ("get", "/api/v1/invitations/{}"), ("get", "/api/v1/tenants/{}"),
    ("get", "/api/v1/plans/{}"), ("get", "/api/v1/invoices/{}"), ("get", "/api/v1/members/{}"),
]  # fmt: skip
BODY_VALUES = [
    None, "", 0, -1, 1e308, 2**64, -(2**64), [], {}, "a" * 10000, "a\x00b", True, "2026-13-45", "NaN", 0.5, [1, 2],
    {"a": 1},
]  # fmt: skip


@pytest.fixture
def callers():
    tenant = TenantFactory(slug="acme")
    owner = MembershipFactory(tenant=tenant, role="owner")
    developer = MembershipFactory(tenant=tenant, role="developer")
    key, plaintext = make_key(tenant)
    clients = {"key": APIClient(), "owner": APIClient(), "staff": APIClient()}
    clients["key"].credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    clients["owner"].force_login(owner.user, backend="django.contrib.auth.backends.ModelBackend")
    clients["staff"].force_login(UserFactory(is_staff=True), backend="django.contrib.auth.backends.ModelBackend")
    for client in clients.values():
        client.raise_request_exception = False
    return {**clients, "key_prefix": key.prefix, "developer": developer.pk}


def _fine(response) -> bool:
    json_or_csv = response["Content-Type"].startswith(("application/json", "text/csv"))
    return response.status_code < 500 and (response.status_code == 204 or json_or_csv)


def test_hostile_query_values_and_path_segments(callers):
    failures = []
    for path, params in QUERIES.items():
        client = callers["staff" if path in STAFF_PATHS else "key"]
        for param, value in itertools.product(params, QUERY_VALUES):
            response = client.get(f"{path}?{param}={value}")
            if not _fine(response):
                failures.append((path, param, value[:20], response.status_code))
    for (method, template), value, who in itertools.product(SEGMENTS, QUERY_VALUES, ("key", "staff")):
        response = getattr(callers[who], method)(template.format(value))
        if not _fine(response):
            failures.append((template, value[:20], who, response.status_code))
    assert failures == []


def test_hostile_body_fields(callers):
    cases = [
        ("key", "post", "/api/v1/keys", {"name": "k", "scopes": ["inference"]}),
        ("key", "post", f"/api/v1/keys/{callers['key_prefix']}/rotate", {"grace_seconds": 10}),
        ("owner", "patch", "/api/v1/tenant", {"billing_email": "a@b.com", "webhook_url": ""}),
        ("owner", "post", "/api/v1/tenant/webhook-secret", {"secret": "s" * 40}),
        ("owner", "post", "/api/v1/members", {"email": "x@y.com", "role": "viewer"}),
        ("owner", "patch", f"/api/v1/members/{callers['developer']}", {"role": "viewer"}),
        ("staff", "post", "/api/v1/tenants", {"slug": "newt", "name": "N", "plan": "starter", "billing_email": ""}),
        ("staff", "patch", "/api/v1/tenants/acme", {"name": "A", "plan": "starter", "status": "active"}),
        ("staff", "post", "/api/v1/plans", {"slug": "p1", "name": "P", "requests_per_minute": 5,
                                            "monthly_spend_limit": "5", "scheduling_weight": "1",
                                            "price_input_per_mtok": "1", "monthly_token_budget": 5}),
        ("staff", "patch", "/api/v1/plans/starter", {"max_adapter_bytes": 5, "default_max_tokens": 5,
                                                     "price_output_per_mtok": "1"}),
        ("key", "post", "/api/v1/adapters/x/promote", {"version": 1}),
        ("owner", "post", "/api/v1/invitations/some-token", {"username": "u", "password": "p"}),
    ]  # fmt: skip
    failures = []
    for who, method, path, base in cases:
        for field, value in itertools.product(list(base), BODY_VALUES):
            response = getattr(callers[who], method)(path, {**base, field: value}, format="json")
            if not _fine(response):
                failures.append((path, field, str(value)[:20], response.status_code))
    assert failures == []
