import pytest
from rest_framework.test import APIClient

from tests.platform.factories import MembershipFactory, TenantFactory, make_key

MODEL_BACKEND = "django.contrib.auth.backends.ModelBackend"


@pytest.fixture
def tenant_a(db):
    return TenantFactory(slug="tenant-a")


@pytest.fixture
def tenant_b(db):
    return TenantFactory(slug="tenant-b")


def client_for_member(membership) -> APIClient:
    client = APIClient()
    client.force_login(membership.user, backend=MODEL_BACKEND)
    return client


def client_for_key(plaintext: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    return client


@pytest.fixture
def member_client():
    def build(tenant, role="owner"):
        membership = MembershipFactory(tenant=tenant, role=role)
        return client_for_member(membership), membership

    return build


@pytest.fixture
def key_client():
    def build(tenant, scopes=("admin",), **fields):
        key, plaintext = make_key(tenant, scopes=scopes, **fields)
        return client_for_key(plaintext), key, plaintext

    return build
