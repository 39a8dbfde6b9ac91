"""Every list the management API pages through has a total order: its last ordering field is unique within the list
(an id, or a field unique there), so that ?offset= never shows a row twice or skips one when rows tie."""

import pytest
from django.db.models import QuerySet

from apikeys.selectors import api_keys_of
from billing.selectors import invoices_of
from finetuning.selectors import files_of, jobs_of
from registry.selectors import adapter_versions, adapters_of, base_models_active
from tenancy.audit import Actor
from tenancy.models import Plan, Tenant
from tenancy.selectors import audit_log_list, invitations_of, members_of
from tests.platform.factories import make_key

pytestmark = pytest.mark.django_db

UNIQUE_IN_LIST = {"id", "pk", "slug", "name", "number", "user__username"}  # each unique where its list is filtered


def _ordering(queryset: QuerySet) -> list[str]:
    return list(queryset.query.order_by or queryset.model._meta.ordering)


def _lists(tenant) -> dict[str, QuerySet]:
    from registry.models import Adapter, BaseModel

    base = BaseModel.objects.create(name="order-base", checkpoint_dir="/nowhere", architecture="llama", config={},
                                    max_context=256)  # fmt: skip
    adapter = Adapter.objects.create(tenant=tenant, name="x", base_model=base)
    return {
        "keys": api_keys_of(tenant=tenant), "invoices": invoices_of(tenant=tenant, reader=Actor.system()), "members": members_of(tenant=tenant),
        "invitations": invitations_of(tenant=tenant), "audit": audit_log_list(tenant=tenant),
        "adapters": adapters_of(tenant=tenant), "versions": adapter_versions(adapter=adapter),
        "base-models": base_models_active(), "files": files_of(tenant=tenant), "jobs": jobs_of(tenant=tenant),
        "plans": Plan.objects.all(), "tenants": Tenant.objects.order_by("slug"),
    }  # fmt: skip


def test_every_list_ends_its_ordering_on_a_unique_field(tenant_a):
    for name, queryset in _lists(tenant_a).items():
        ordering = _ordering(queryset)
        assert ordering and ordering[-1].lstrip("-") in UNIQUE_IN_LIST, (name, ordering)


def test_keys_created_in_the_same_instant_page_without_repeats(tenant_a, key_client):
    from apikeys.models import ApiKey

    client = key_client(tenant_a)[0]
    for i in range(4):
        make_key(tenant_a, scopes=["inference"], name=f"same-{i}")
    instant = ApiKey.objects.filter(tenant=tenant_a).first().created
    ApiKey.objects.filter(tenant=tenant_a).update(created=instant)
    seen = [client.get(f"/api/v1/keys?limit=1&offset={i}").json()["results"][0]["prefix"] for i in range(5)]
    assert len(set(seen)) == 5
    assert seen == [k.prefix for k in ApiKey.objects.filter(tenant=tenant_a).order_by("-id")]
