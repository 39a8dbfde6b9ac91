"""Hot-swap: promote and rollback are atomic, audited once, signalled on commit; tenants never see each other."""

import threading
import time

import pytest
from django.db import connection, transaction

from registry.models import Adapter, AdapterPromotion, AdapterVersion
from registry.promotion import adapter_lock, adapter_promote
from registry.selectors import ModelNotFound, model_resolve, models_for_tenant
from registry.signals import adapter_version_promoted
from tenancy.audit import Actor
from tenancy.models import AuditLog
from tests.registry.conftest import BASE_NAME, create_adapter, ready_version, upload


@pytest.fixture
def writer(tenant_a, key_client):
    return key_client(tenant_a, scopes=["adapters:write"])[0]


@pytest.fixture
def promoted(db):
    received = []

    def receiver(sender, adapter, version, previous_version, **kwargs):
        received.append((adapter.name, version.number, previous_version.number if previous_version else None))

    adapter_version_promoted.connect(receiver)
    yield received
    adapter_version_promoted.disconnect(receiver)


def _one_audit_row(client, method, url, body, action):
    before = AuditLog.objects.count()
    response = getattr(client, method)(url, body, format="multipart" if "file" in (body or {}) else "json")
    assert response.status_code < 300, response.content
    assert list(AuditLog.objects.order_by("id").values_list("action", flat=True)[before:]) == [action]
    return response


@pytest.mark.django_db
def test_promote_and_rollback_move_the_alias(
    tenant_a, writer, base_model, adapter_zip, other_adapter_zip, third_adapter_zip, media_root, promoted,
    django_capture_on_commit_callbacks,
):  # fmt: skip
    with django_capture_on_commit_callbacks(execute=True):
        ready_version(writer, "bot", adapter_zip)
        ready_version(writer, "bot", other_adapter_zip)
        ready_version(writer, "bot", third_adapter_zip)
    assert promoted == [("bot", 1, None)], "only the first ready version is promoted by itself"
    assert model_resolve(tenant=tenant_a, name="bot").version.number == 1
    with django_capture_on_commit_callbacks(execute=True):
        body = writer.post("/api/v1/adapters/bot/promote", {"version": 3}, format="json").json()
        assert (body["current_version"], body["previous_version"]) == (3, 1)
        writer.post("/api/v1/adapters/bot/promote", {"version": 2}, format="json")
    assert model_resolve(tenant=tenant_a, name="bot").version.number == 2
    assert model_resolve(tenant=tenant_a, name="bot@3").version.number == 3
    with django_capture_on_commit_callbacks(execute=True):
        assert writer.post("/api/v1/adapters/bot/rollback").json()["current_version"] == 3
        assert writer.post("/api/v1/adapters/bot/rollback").json()["current_version"] == 1
    assert promoted[1:] == [("bot", 3, 1), ("bot", 2, 3), ("bot", 3, 2), ("bot", 1, 3)]
    response = writer.post("/api/v1/adapters/bot/rollback")
    assert response.status_code == 409 and response.json()["error"]["code"] == "nothing_to_roll_back"
    response = writer.post("/api/v1/adapters/bot/promote", {"version": 1}, format="json")
    assert response.status_code == 409 and response.json()["error"]["code"] == "already_current"
    assert writer.post("/api/v1/adapters/bot/promote", {"version": 9}, format="json").status_code == 404


@pytest.mark.django_db
def test_only_ready_versions_can_be_promoted(writer, base_model, adapter_zip, third_adapter_zip, wrong_base_zip,
                                             media_root):  # fmt: skip
    ready_version(writer, "bot", adapter_zip)
    failed = ready_version(writer, "bot", wrong_base_zip)
    assert failed.status == "failed"
    writer.post("/api/v1/adapters/bot/versions", {"file": upload("v.zip", third_adapter_zip)}, format="multipart")
    for number, status in ((2, "failed"), (3, "uploaded")):
        response = writer.post("/api/v1/adapters/bot/promote", {"version": number}, format="json")
        assert response.status_code == 409
        assert response.json()["error"] == {
            "message": f"Version {number} is {status}; only a ready version can be promoted.",
            "type": "conflict_error", "code": "version_not_ready",
        }  # fmt: skip
    assert Adapter.objects.get(name="bot").current_version.number == 1


@pytest.mark.django_db
def test_every_mutating_endpoint_writes_exactly_one_audit_row(writer, base_model, adapter_zip, other_adapter_zip,
                                                              media_root):  # fmt: skip
    url = "/api/v1/adapters"
    _one_audit_row(writer, "post", url, {"name": "bot", "base_model": BASE_NAME, "file": upload("a.zip", adapter_zip)},
                   "adapter.create")  # fmt: skip
    _one_audit_row(writer, "post", f"{url}/bot/versions", {"file": upload("b.zip", other_adapter_zip)},
                   "adapter_version.create")  # fmt: skip
    from registry.validation import adapter_version_validate

    for version in AdapterVersion.objects.order_by("number"):
        adapter_version_validate(version_id=version.pk)
    _one_audit_row(writer, "post", f"{url}/bot/promote", {"version": 2}, "adapter.promote")
    _one_audit_row(writer, "post", f"{url}/bot/rollback", None, "adapter.rollback")
    row = _one_audit_row(writer, "delete", f"{url}/bot", None, "adapter.delete")
    assert row.status_code == 204
    assert AuditLog.objects.get(action="adapter.delete").before == {"name": "bot", "current_version": 1}


@pytest.mark.django_db
def test_tenant_b_can_neither_see_nor_touch_tenant_a_adapters(
    tenant_a, tenant_b, writer, key_client, member_client, base_model, adapter_zip, media_root
):
    ready_version(writer, "secret", adapter_zip)
    other, _, _ = key_client(tenant_b, scopes=["admin"])
    owner_b, _ = member_client(tenant_b, "owner")
    for client in (other, owner_b):
        assert client.get("/api/v1/adapters").json()["results"] == []
        assert client.get("/api/v1/adapters/secret").status_code == 404
        assert client.get("/api/v1/adapters/secret/versions").status_code == 404
        assert client.post("/api/v1/adapters/secret/promote", {"version": 1}, format="json").status_code == 404
        assert client.post("/api/v1/adapters/secret/rollback").status_code == 404
        assert client.delete("/api/v1/adapters/secret").status_code == 404
        response = client.post("/api/v1/adapters/secret/versions", {"file": upload("a.zip", adapter_zip)},
                               format="multipart")  # fmt: skip
        assert response.status_code == 404
    for name in ("secret", "secret@1"):
        with pytest.raises(ModelNotFound) as refused:
            model_resolve(tenant=tenant_b, name=name)
        assert "does not exist or you do not have access" in refused.value.message
    assert [m.name for m in models_for_tenant(tenant=tenant_b)] == [BASE_NAME]
    assert [m.name for m in models_for_tenant(tenant=tenant_a)] == [BASE_NAME, "secret"]
    assert create_adapter(other, "secret", adapter_zip).status_code == 201, "names are per tenant"
    assert Adapter.objects.get(tenant=tenant_a, name="secret").versions.count() == 1


@pytest.mark.django_db
def test_resolve_and_delete(tenant_a, writer, base_model, adapter_zip, wrong_base_zip, media_root):
    assert model_resolve(tenant=tenant_a, name=BASE_NAME).adapter is None
    create_adapter(writer, "pending", adapter_zip)
    with pytest.raises(ModelNotFound, match="has no ready version yet"):
        model_resolve(tenant=tenant_a, name="pending")
    ready_version(writer, "bot", adapter_zip)
    ready_version(writer, "bot", wrong_base_zip)
    for name in ("bot@2", "bot@7", "bot@x"):
        with pytest.raises(ModelNotFound):
            model_resolve(tenant=tenant_a, name=name)
    resolved = model_resolve(tenant=tenant_a, name="bot@1")
    assert resolved.base_model == base_model and resolved.version.status == "ready"
    assert writer.delete("/api/v1/adapters/bot").status_code == 204
    with pytest.raises(ModelNotFound):
        model_resolve(tenant=tenant_a, name="bot")
    assert writer.get("/api/v1/adapters/bot").status_code == 404
    assert [m.name for m in models_for_tenant(tenant=tenant_a)] == [BASE_NAME]
    assert create_adapter(writer, "bot", adapter_zip).json()["version"]["number"] == 1


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_promotes_leave_a_consistent_alias(tenant_a, key_client, base_model, adapter_zip,
                                                          other_adapter_zip, third_adapter_zip, media_root):  # fmt: skip
    writer = key_client(tenant_a, scopes=["adapters:write"])[0]
    for data in (adapter_zip, other_adapter_zip, third_adapter_zip):
        ready_version(writer, "bot", data)
    adapter = Adapter.objects.get(name="bot")
    held, release = threading.Event(), threading.Event()
    errors = []

    def hold_the_row() -> None:
        """A third transaction holds the adapter's row, so both promotes queue up and then race for it."""
        try:
            with transaction.atomic():
                adapter_lock(adapter)
                held.set()
                release.wait(timeout=30)
        finally:
            connection.close()

    def promote(number: int) -> None:
        try:
            adapter_promote(actor=Actor.system(), adapter=adapter, version_number=number)
        except Exception as error:  # collected and asserted on below
            errors.append(error)
        finally:
            connection.close()

    holder = threading.Thread(target=hold_the_row)
    holder.start()
    held.wait(timeout=30)
    threads = [threading.Thread(target=promote, args=(number,)) for number in (2, 3)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # let both reach the lock (if one is late the test only gets weaker, never flaky)
    release.set()
    for thread in [holder, *threads]:
        thread.join()
    assert errors == []
    adapter.refresh_from_db()
    stack = list(AdapterPromotion.objects.filter(adapter=adapter, rolled_back_at__isnull=True).order_by("id"))
    assert [p.version.number for p in stack][0] == 1 and sorted(p.version.number for p in stack[1:]) == [2, 3]
    assert adapter.current_version == stack[-1].version
    promotes = AuditLog.objects.filter(action="adapter.promote").order_by("id")
    assert [row.after["version"] for row in promotes] == [p.version.number for p in stack]
    assert [row.before["version"] for row in promotes] == [None] + [p.version.number for p in stack[:-1]]
