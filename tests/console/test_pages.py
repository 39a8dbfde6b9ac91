"""Every console page renders for the people who may see it, and only for them."""

import pytest
from django.urls import reverse

from apikeys.services import api_key_create
from tenancy.audit import Actor
from tests.engine_states import adapters, engine_state_json

pytestmark = pytest.mark.django_db

TENANT_PAGES = ["tenant-overview", "keys", "members", "adapters", "adapter-upload", "usage", "billing", "audit"]
PLATFORM_PAGES = ["platform", "tenants", "tenant-new", "engines", "plans", "plan-new", "platform-audit"]


def tenant_url(name: str, tenant) -> str:
    return reverse(f"console:{name}", kwargs={"slug": tenant.slug})


def test_an_owner_opens_every_page_of_their_tenant(tenant, member_of, base_model):
    client, _ = member_of(tenant, "owner")
    api_key_create(actor=Actor.system(), tenant=tenant, name="backend", scopes=["inference"])
    for name in TENANT_PAGES:
        response = client.get(tenant_url(name, tenant))
        assert response.status_code == 200, (name, response.status_code)
        assert b"Acme Corp" in response.content


def test_staff_open_every_platform_page_and_members_do_not(tenant, staff_client, member_of):
    client, _ = member_of(tenant, "owner")
    for name in PLATFORM_PAGES:
        url = reverse(f"console:{name}")
        assert staff_client.get(url).status_code == 200, name
        assert client.get(url).status_code == 403, name
    assert staff_client.get(reverse("console:tenant-detail", kwargs={"slug": tenant.slug})).status_code == 200
    assert staff_client.get(reverse("console:plan-edit", kwargs={"plan_slug": tenant.plan.slug})).status_code == 200


def test_a_member_of_tenant_a_can_not_open_tenant_b(tenant, other_tenant, member_of):
    client, _ = member_of(tenant, "owner")
    for name in TENANT_PAGES:
        assert client.get(tenant_url(name, other_tenant)).status_code == 404, name
    assert client.post(tenant_url("keys", other_tenant), {"name": "x", "scopes": ["inference"]}).status_code == 404
    assert not other_tenant.api_keys.exists()


def test_the_switcher_lists_only_the_users_tenants(tenant, other_tenant, member_of):
    client, membership = member_of(tenant, "viewer")
    page = client.get(tenant_url("tenant-overview", tenant)).content.decode()
    assert 'value="acme"' in page and 'value="globex"' not in page
    assert client.get(reverse("console:switch") + "?tenant=globex", follow=True).status_code == 404


def test_logged_out_visitors_go_to_the_login_page(tenant, client):
    response = client.get(tenant_url("keys", tenant))
    assert response.status_code == 302
    assert response.url.startswith(reverse("console:login"))


def test_home_remembers_the_last_tenant(tenant, other_tenant, member_of):
    client, membership = member_of(tenant, "viewer")
    MembershipFactory = type(membership)
    MembershipFactory.objects.create(user=membership.user, tenant=other_tenant, role="viewer")
    client.get(tenant_url("usage", other_tenant))
    assert client.get("/").url == tenant_url("tenant-overview", other_tenant)
    assert client.session["quilt_tenant"] == "globex"


@pytest.mark.parametrize(
    ("role", "visible"),
    [
        ("viewer", {"tenant-overview", "keys", "members", "adapters", "usage"}),
        ("developer", {"tenant-overview", "keys", "members", "adapters", "adapter-upload", "usage"}),
        ("admin", set(TENANT_PAGES)),
    ],
)
def test_pages_follow_the_role(role, visible, tenant, member_of):
    client, _ = member_of(tenant, role)
    for name in TENANT_PAGES:
        expected = 200 if name in visible else 403
        assert client.get(tenant_url(name, tenant)).status_code == expected, (role, name)


@pytest.mark.parametrize(
    ("status", "banner"),
    [
        ("suspended", b"This tenant is suspended."),
        ("closed", b"This tenant is closed."),
        ("active", None),
    ],
)
def test_members_of_a_tenant_that_is_not_active_see_why_on_every_page(tenant, member_of, status, banner):
    tenant.status = status
    tenant.save(update_fields=["status"])
    client, _ = member_of(tenant, "owner")
    for name in ["tenant-overview", "keys"]:
        content = client.get(tenant_url(name, tenant)).content
        if banner is None:
            assert b"This tenant is" not in content, name
        else:
            assert banner in content and b"API keys are refused" in content, name


def test_the_engines_page_without_engines_says_how_engines_join(staff_client):
    from gateway.models import Engine

    Engine.objects.all().delete()
    page = staff_client.get(reverse("console:engines")).content.decode()
    assert "No engines yet" in page and "--control-plane" in page
    assert "registerengine" not in page  # engines register themselves now (docs/fleet.md)


def test_the_engines_page_names_a_shared_adapter_by_its_busiest_version_and_lists_each_in_its_real_tier(
    staff_client, tenant, other_tenant
):
    """Identical uploads share one digest: the chip names the version with the most requests, not the first
    uploaded (and counts the others); an adapter on the GPU, which the engine also lists in host memory, shows under GPU only."""
    from datetime import timedelta
    from decimal import Decimal

    from django.utils import timezone

    from gateway.models import Engine
    from metering.models import UsageEvent
    from registry.models import Adapter, AdapterVersion, BaseModel

    base = BaseModel.objects.create(name="tiny", checkpoint_dir="/nowhere", architecture="llama", config={},
                                    max_context=256)  # fmt: skip
    shout, spare = "a" * 64, "b" * 64
    AdapterVersion.objects.create(adapter=Adapter.objects.create(tenant=other_tenant, name="shout", base_model=base),
                                  number=1, digest=shout)  # fmt: skip
    demo = AdapterVersion.objects.create(adapter=Adapter.objects.create(tenant=tenant, name="shout", base_model=base),
                                         number=1, digest=shout)  # fmt: skip
    AdapterVersion.objects.create(adapter=Adapter.objects.create(tenant=tenant, name="spare", base_model=base),
                                  number=1, digest=spare)  # fmt: skip
    for number in range(3):
        UsageEvent.objects.create(
            request_id=f"shout-{number}", tenant=tenant, model="shout", base_model="tiny", adapter_version=demo,
            prompt_tokens=1, completion_tokens=1,
            price_input_per_mtok=0, price_cached_input_per_mtok=0, price_output_per_mtok=0, price=Decimal(0),
            finished_at=timezone.now() - timedelta(hours=1),
        )  # fmt: skip
    Engine.objects.create(name="gpu-a", url="http://10.0.0.1:8100", gpu_price_per_hour=Decimal(1), healthy=True,
                          state=engine_state_json(adapters=adapters(gpu=[shout], host=[shout, spare])))  # fmt: skip
    page = staff_client.get(reverse("console:engines")).content.decode()
    gpu = page[page.index(">GPU"):page.index(">Host memory only")]
    host = page[page.index(">Host memory only"):page.index(">Loading")]
    assert 'data-adapter="acme/shout@1" title="The same tensors as globex/shout@1">acme/shout@1' in gpu
    assert "acme/shout@1" not in host and 'data-adapter="acme/spare@1"' in host


def test_a_refusal_for_a_role_reads_as_a_sentence(tenant, member_of):
    client, _ = member_of(tenant, "developer")
    page = client.get(tenant_url("billing", tenant))
    assert page.status_code == 403
    assert "You may not read billing and invoices: it needs the admin role or higher." in page.content.decode()
