"""Keys: shown once, stored hashed, refused when revoked, expired, suspended or rotated past their grace."""

from datetime import timedelta

import pytest
from django.apps import apps
from django.core.management import call_command
from django.db import connection, models
from django.utils import timezone
from freezegun import freeze_time

from apikeys.models import ApiKey
from tests.platform.conftest import client_for_key

pytestmark = pytest.mark.django_db


def _every_text_value_in_the_database() -> str:
    chunks = []
    with connection.cursor() as cursor:
        for model in apps.get_models():
            text_columns = [
                field.column for field in model._meta.concrete_fields
                if isinstance(field, models.CharField | models.TextField | models.JSONField)
            ]  # fmt: skip
            if not text_columns:
                continue
            columns = ", ".join(f'CAST("{column}" AS TEXT)' for column in text_columns)
            cursor.execute(f'SELECT {columns} FROM "{model._meta.db_table}"')
            chunks.extend(str(value) for row in cursor.fetchall() for value in row if value is not None)
    return "\n".join(chunks)


def test_no_plaintext_secret_anywhere_after_create_rotate_and_revoke(tenant_a, member_client):
    client, _ = member_client(tenant_a, "owner")
    created = client.post("/api/v1/keys", {"name": "prod", "scopes": ["inference"]}, format="json").json()
    rotated = client.post(f"/api/v1/keys/{created['id']}/rotate", {"grace_seconds": 60}, format="json").json()
    assert client.post(f"/api/v1/keys/{rotated['id']}/revoke").status_code == 200
    second = client.get(f"/api/v1/keys/{created['id']}").json()
    assert "key" not in second
    call_command("createapikey", tenant_a.slug, "cli", "--scopes", "inference", stdout=(out := _Capture()))
    secrets = [created["key"], rotated["key"], out.text.strip()]
    everything = _every_text_value_in_the_database()
    for secret in secrets:
        assert len(secret) > 30
        assert secret.split(".", 1)[1] not in everything


class _Capture:
    def __init__(self):
        self.text = ""

    def write(self, text):
        self.text += text

    def flush(self):
        pass


def _status(plaintext: str) -> int:
    return client_for_key(plaintext).get("/api/v1/tenant").status_code


def test_valid_key_works_and_records_last_use(tenant_a, key_client):
    _, key, plaintext = key_client(tenant_a)
    assert _status(plaintext) == 200
    key.refresh_from_db()
    assert key.last_used_at is not None


def test_revoked_key_is_refused_at_once(tenant_a, key_client, member_client):
    _, key, plaintext = key_client(tenant_a)
    assert _status(plaintext) == 200
    owner, _ = member_client(tenant_a, "owner")
    assert owner.post(f"/api/v1/keys/{key.prefix}/revoke").status_code == 200
    with freeze_time(timezone.now() + timedelta(seconds=2)):  # past the 1 s key cache
        response = client_for_key(plaintext).get("/api/v1/tenant")
    assert response.status_code == 401
    assert "revoked" in response.json()["error"]["message"]


def test_expired_key_is_refused(tenant_a, key_client):
    _, _, plaintext = key_client(tenant_a, expiry_date=timezone.now() + timedelta(minutes=5))
    assert _status(plaintext) == 200
    with freeze_time(timezone.now() + timedelta(minutes=6)):
        response = client_for_key(plaintext).get("/api/v1/tenant")
    assert response.status_code == 401
    assert "expired" in response.json()["error"]["message"]


def test_suspended_tenants_keys_stop_working(tenant_a, key_client):
    _, _, plaintext = key_client(tenant_a)
    assert _status(plaintext) == 200
    tenant_a.status = "suspended"
    tenant_a.save()
    with freeze_time(timezone.now() + timedelta(seconds=2)):
        response = client_for_key(plaintext).get("/api/v1/tenant")
    assert response.status_code == 403
    assert "suspended" in response.json()["error"]["message"]


def test_rotated_key_works_within_grace_and_is_refused_after(tenant_a, key_client, member_client):
    _, old_key, old_plaintext = key_client(tenant_a, scopes=("inference",))
    owner, _ = member_client(tenant_a, "owner")
    response = owner.post(f"/api/v1/keys/{old_key.prefix}/rotate", {"grace_seconds": 600}, format="json")
    assert response.status_code == 201
    new_plaintext = response.json()["key"]
    assert response.json()["scopes"] == ["inference"]
    assert _status(old_plaintext) == 200
    assert _status(new_plaintext) == 200
    with freeze_time(timezone.now() + timedelta(seconds=601)):
        assert client_for_key(old_plaintext).get("/api/v1/tenant").status_code == 401
        assert client_for_key(new_plaintext).get("/api/v1/tenant").status_code == 200
    assert ApiKey.objects.get(pk=old_key.pk).replaced_by.prefix == response.json()["id"]


def test_a_wrong_secret_with_a_real_prefix_is_refused(tenant_a, key_client):
    _, key, plaintext = key_client(tenant_a)
    assert _status(f"{key.prefix}.{'x' * 32}") == 401


def test_bad_key_input_is_a_clear_400(tenant_a, member_client):
    client, _ = member_client(tenant_a, "owner")
    response = client.post("/api/v1/keys", {"name": "x", "scopes": ["root"]}, format="json")
    assert response.status_code == 400
    assert "scopes" in response.json()["error"]["message"]
    past = (timezone.now() - timedelta(days=1)).isoformat()
    response = client.post("/api/v1/keys", {"name": "x", "scopes": ["inference"], "expiry_date": past}, format="json")
    assert response.status_code == 422  # a date as the schema says, in the past: no schema can say that
    assert "future" in response.json()["error"]["message"] and response.json()["error"]["code"] == "expiry_past"
    assert not ApiKey.objects.exists()
