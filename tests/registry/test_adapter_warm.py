"""Marking an adapter always-warm through the API: within the plan's `max_warm_adapters`, audited, announced to the
engines' sync after the commit; past the limit a 403 that says why; a tier the engines do not have is a 400."""

import pytest

from registry.models import Adapter
from registry.signals import adapter_warm_changed
from tenancy.models import AuditLog


@pytest.fixture
def writer(tenant_a, key_client):
    return key_client(tenant_a, scopes=["adapters:write"])[0]


def test_a_warm_tier_within_the_plan_is_set_audited_and_announced(tenant_a, writer, base_model,
                                                                  django_capture_on_commit_callbacks):
    for name in ("one", "two"):
        Adapter.objects.create(tenant=tenant_a, name=name, base_model=base_model)
    tenant_a.plan.max_warm_adapters = 1
    tenant_a.plan.save()
    heard = []
    adapter_warm_changed.connect(lambda sender, adapter, **kwargs: heard.append((adapter.name, adapter.warm_tier)),
                                 weak=False, dispatch_uid="test-warm")  # fmt: skip
    try:
        with django_capture_on_commit_callbacks(execute=True):
            answer = writer.post("/api/v1/adapters/one/warm", {"tier": "gpu"}, format="json")
        assert answer.status_code == 200, answer.content
        assert answer.json()["warm_tier"] == "gpu" and heard == [("one", "gpu")]
        assert AuditLog.objects.filter(action="adapter.warm", tenant=tenant_a).count() == 1

        refused = writer.post("/api/v1/adapters/two/warm", {"tier": "host"}, format="json")
        assert refused.status_code == 403
        error = refused.json()["error"]
        assert error["code"] == "warm_adapter_limit" and "lets 1 adapter(s) be pinned" in error["message"]
        assert Adapter.objects.get(tenant=tenant_a, name="two").warm_tier == ""

        assert writer.post("/api/v1/adapters/one/warm", {"tier": "host"}, format="json").status_code == 200  # a move
        assert writer.post("/api/v1/adapters/two/warm", {"tier": "disk"}, format="json").status_code == 400
        assert writer.post("/api/v1/adapters/one/warm", {"tier": ""}, format="json").json()["warm_tier"] == ""
        assert writer.post("/api/v1/adapters/two/warm", {"tier": "gpu"}, format="json").status_code == 200
    finally:
        adapter_warm_changed.disconnect(dispatch_uid="test-warm")
