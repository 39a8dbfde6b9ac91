"""Staff pages over tenants: search, status, create, plan changes, suspend and reactivate, margins."""

from decimal import Decimal

import pytest
from django.urls import reverse

from apikeys.selectors import KeyRefused, api_key_authenticate
from apikeys.services import api_key_create
from console.money_format import money_exact_text
from gateway.models import Engine
from metering.services import usage_ingest
from tenancy.audit import Actor
from tenancy.models import AuditLog, Plan, Tenant
from tests.console.builders import usage_event
from tests.engine_states import adapters, engine_state_json, memory
from tests.platform.factories import TenantFactory

pytestmark = pytest.mark.django_db


def test_staff_search_and_filter_tenants(staff_client, django_assert_max_num_queries):
    for index in range(40):
        TenantFactory(slug=f"shop-{index:02d}", name=f"Shop {index:02d}")
    TenantFactory(slug="umbrella", name="Umbrella Health", status="suspended")
    with django_assert_max_num_queries(10):
        response = staff_client.get(reverse("console:tenants") + "?sort=-name&page=2")
    rows = response.context["tenants"].rows
    assert [tenant.slug for tenant in rows][:2] == ["shop-15", "shop-14"]
    found = staff_client.get(reverse("console:tenants") + "?q=umbrel").context["tenants"].rows
    assert [tenant.slug for tenant in found] == ["umbrella"]
    suspended = staff_client.get(reverse("console:tenants") + "?status=suspended").context["tenants"].rows
    assert [tenant.slug for tenant in suspended] == ["umbrella"]


def test_staff_create_a_tenant_and_get_told_about_taken_slugs(staff_client, staff):
    plan = Plan.objects.get_or_create(slug="starter", defaults={"name": "Starter"})[0]
    form = {"name": "Acme", "slug": "acme", "plan": plan.slug, "billing_email": "ap@acme.test"}
    response = staff_client.post(reverse("console:tenant-new"), form)
    assert response.status_code == 302 and response.url == reverse("console:tenant-detail", kwargs={"slug": "acme"})
    assert AuditLog.objects.get(action="tenant.create").actor_user == staff
    again = staff_client.post(reverse("console:tenant-new"), form)
    assert again.status_code == 400 and b"already exists" in again.content


def test_plan_changes_and_suspension_take_effect(staff_client, tenant):
    bigger = Plan.objects.create(slug="bigger", name="Bigger")
    kwargs = {"slug": tenant.slug}
    staff_client.post(reverse("console:tenant-plan", kwargs=kwargs), {"plan": "bigger"})
    tenant.refresh_from_db()
    assert tenant.plan == bigger
    _, secret = api_key_create(actor=Actor.system(), tenant=tenant, name="svc", scopes=["inference"])
    staff_client.post(reverse("console:tenant-status", kwargs=kwargs), {"status": "suspended"})
    with pytest.raises(KeyRefused, match="suspended"):
        api_key_authenticate(presented=secret)
    page = staff_client.get(reverse("console:tenant-detail", kwargs=kwargs)).content.decode()
    assert 'data-testid="reactivate"' in page and "data-confirm=" in page
    staff_client.post(reverse("console:tenant-status", kwargs=kwargs), {"status": "active"})
    assert Tenant.objects.get(pk=tenant.pk).status == "active"
    actions = list(AuditLog.objects.filter(tenant=tenant).values_list("action", flat=True))
    assert {"tenant.update", "tenant.suspend", "tenant.reactivate"} <= set(actions)


def test_tenant_pages_show_revenue_cost_and_margin(staff_client, tenant):
    plan = tenant.plan
    plan.price_input_per_mtok, plan.price_output_per_mtok = 1, 2
    plan.save()
    Engine.objects.create(name="engine-1", url="http://127.0.0.1:9", gpu_price_per_hour="36.0")
    usage_ingest(events=[usage_event(tenant, prompt_tokens=1_000_000, cached_tokens=0, completion_tokens=500_000,
                                     gpu_ms=10_000.0)])  # fmt: skip
    detail = staff_client.get(reverse("console:tenant-detail", kwargs={"slug": tenant.slug}))
    margin = detail.context["margin"]
    assert [round(value, 6) for value in (margin.revenue, margin.gpu_cost, margin.margin)] == [
        Decimal(2), Decimal("0.1"), Decimal("1.9")
    ]
    assert b"$2.00" in detail.content and b"$1.90" in detail.content
    listed = staff_client.get(reverse("console:tenants")).context["tenants"].rows
    assert listed[0].margin.revenue == 2


def test_the_tenant_page_shows_admission_drift(staff_client, tenant):
    from gateway.selectors import admission_month_drift
    from metering.models import UsageMonth

    usage_ingest(events=[usage_event(tenant, prompt_tokens=1_000, cached_tokens=0, completion_tokens=500)])
    assert admission_month_drift(tenant_id=tenant.pk).drift_tokens == 0  # admission's month total starts at 1,500
    UsageMonth.objects.filter(tenant=tenant).update(prompt_tokens=200)  # the record loses 800 tokens admission counted
    detail = staff_client.get(reverse("console:tenant-detail", kwargs={"slug": tenant.slug}))
    drift = detail.context["drift"]
    assert (drift.admission_tokens, drift.recorded_tokens, drift.drift_tokens) == (1_500, 700, 800)
    assert b"Redis month total vs recorded usage" in detail.content
    assert f'data-drift="tokens">{drift.drift_tokens}<'.encode() in detail.content
    assert f'data-drift="spend">{money_exact_text(drift.drift_spend)}<'.encode() in detail.content


def test_platform_pages_cost_a_fixed_number_of_queries(staff_client, django_assert_max_num_queries):
    tenants = [TenantFactory(slug=f"t-{index:02d}") for index in range(30)]
    usage_ingest(events=[usage_event(tenant) for tenant in tenants])
    for index in range(5):
        Engine.objects.create(name=f"gpu-{index}", url=f"http://10.0.0.{index}:8100", healthy=index % 2 == 0,
                              state=engine_state_json(running=index, adapters=adapters(gpu=["f" * 64])))  # fmt: skip
    with django_assert_max_num_queries(14):
        platform = staff_client.get(reverse("console:platform"))
    assert platform.context["requests"] == 30 and platform.context["healthy_engines"] == 3
    with django_assert_max_num_queries(8):
        engines = staff_client.get(reverse("console:engines"))
    assert engines.content.count(b"data-engine=") == 5


def test_staff_edit_plan_prices_and_create_plans(staff_client, staff):
    plan = Plan.objects.create(slug="pro", name="Pro", price_output_per_mtok=Decimal("2.000000"))
    page = staff_client.get(reverse("console:plan-edit", kwargs={"plan_slug": "pro"}))
    form = {name: "" if value is None else value for name, value in page.context["form"].initial.items()}
    form.pop("id", None)
    response = staff_client.post(reverse("console:plan-edit", kwargs={"plan_slug": "pro"}),
                                 {**form, "price_output_per_mtok": "2.5", "price_training_per_mtok": "3.75",
                                  "max_concurrent_fine_tuning_jobs": "4"})  # fmt: skip
    assert response.status_code == 302
    plan.refresh_from_db()
    assert plan.price_output_per_mtok == Decimal("2.5")
    assert (plan.price_training_per_mtok, plan.max_concurrent_fine_tuning_jobs) == (Decimal("3.75"), 4)
    change = AuditLog.objects.get(action="plan.update")
    assert change.actor_user == staff and Decimal(change.after["price_output_per_mtok"]) == Decimal("2.5")
    refused = staff_client.post(reverse("console:plan-edit", kwargs={"plan_slug": "pro"}),
                                {**form, "price_output_per_mtok": "-1"})  # fmt: skip
    assert refused.status_code == 400
    refused = staff_client.post(reverse("console:plan-edit", kwargs={"plan_slug": "pro"}),
                                {**form, "price_training_per_mtok": "-1"})  # fmt: skip
    assert refused.status_code == 400
    created = staff_client.post(reverse("console:plan-new"), {**form, "slug": "team", "name": "Team"})
    assert created.status_code == 302 and Plan.objects.filter(slug="team").exists()


def test_the_engines_page_shows_the_memory_split_from_the_engine_state(staff_client):
    split = memory(page_bytes=1 << 20, pages_total=64, base_weights_bytes=192 << 20, kv_pages_bytes=40 << 20,
                   adapter_pages_bytes=8 << 20, free_bytes=16 << 20)  # fmt: skip
    Engine.objects.create(name="mem-1", url="http://127.0.0.1:9", healthy=True,
                          state=engine_state_json(running=1, kv_blocks_used=40, kv_blocks_total=64, memory=split))
    Engine.objects.create(name="old-1", url="http://127.0.0.1:10", healthy=True, state={})
    page = staff_client.get(reverse("console:engines")).content.decode()
    card = page[page.index('data-engine="mem-1"'):page.index('data-engine="old-1"')]
    for kind, text in [("base_weights", "Base weights 192.0 MB"), ("kv_pages", "KV pages 40.0 MB"),
                       ("adapter_pages", "Adapter pages 8.0 MB"), ("free", "Free 16.0 MB")]:
        assert f'data-memory="{kind}"><i class="mem-{kind}"></i>{text}</span>' in card
    assert 'class="mem-base_weights" style="width:75.0%"' in card and "slots" not in page
    assert 'data-testid="memory"' not in page[page.index('data-engine="old-1"'):]


def test_the_tenant_page_lists_its_pending_invitations(staff_client, staff, tenant):
    from tenancy.invitations import invitation_create, invitation_revoke

    invitation_create(actor=Actor(user=staff), tenant=tenant, email="dana@acme.test", role="owner")
    revoked, _ = invitation_create(actor=Actor(user=staff), tenant=tenant, email="eve@acme.test", role="viewer")
    invitation_revoke(actor=Actor(user=staff), invitation=revoked)
    page = staff_client.get(reverse("console:tenant-detail", kwargs={"slug": tenant.slug})).content.decode()
    assert 'data-invitation="dana@acme.test"' in page and "eve@acme.test" not in page
    assert "No members yet: the invitations below are not accepted yet." in page
