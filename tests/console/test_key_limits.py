"""Per-key controls in the console and the API: each key's spend this month in the keys table, and its own
monthly budget and RPM/TPM limits, set by an admin (audited), copied by a rotation, refused to a developer."""

from decimal import Decimal

import pytest
from django.urls import reverse

from apikeys.models import ApiKey
from apikeys.services import api_key_create, api_key_rotate
from metering.services import usage_ingest
from tenancy.audit import Actor
from tenancy.models import AuditLog
from tests.console.builders import usage_event
from tests.platform.conftest import client_for_key
from tests.platform.factories import make_key

pytestmark = pytest.mark.django_db


def _limits_url(tenant, key) -> str:
    return reverse("console:key-limits", kwargs={"slug": tenant.slug, "prefix": key.prefix})


def test_the_keys_table_shows_each_keys_spend_this_month(tenant, member_of):
    from tenancy.models import Plan

    Plan.objects.filter(pk=tenant.plan_id).update(price_output_per_mtok=Decimal("1000"))
    client, _ = member_of(tenant, "viewer")
    busy, _ = api_key_create(actor=Actor.system(), tenant=tenant, name="busy", scopes=["inference"])
    api_key_create(actor=Actor.system(), tenant=tenant, name="idle", scopes=["inference"])
    usage_ingest(events=[usage_event(tenant, api_key=busy, prompt_tokens=0, cached_tokens=0, completion_tokens=3000)
                         for _ in range(2)])  # fmt: skip
    page = client.get(reverse("console:keys", kwargs={"slug": tenant.slug}))
    spend = {key.name: key.spend_this_month for key in page.context["keys"].rows}
    assert spend == {"busy": Decimal("6"), "idle": Decimal(0)}
    assert "$6.00" in page.content.decode() and "Spend this month" in page.content.decode()
    assert 'data-testid="edit-limits"' not in page.content.decode()  # a viewer sets nothing


def test_an_admin_sets_a_keys_budget_and_limits_and_a_rotation_keeps_them(tenant, member_of):
    client, membership = member_of(tenant, "admin")
    key, _ = api_key_create(actor=Actor.system(), tenant=tenant, name="svc", scopes=["inference"])
    response = client.post(_limits_url(tenant, key), {"monthly_spend_limit": "12.50", "requests_per_minute": "30",
                                                      "tokens_per_minute": ""}, follow=True)  # fmt: skip
    assert response.status_code == 200 and "Saved the budget and limits" in response.content.decode()
    key.refresh_from_db()
    assert (key.monthly_spend_limit, key.requests_per_minute, key.tokens_per_minute) == (Decimal("12.50"), 30, None)
    entry = AuditLog.objects.get(action="api_key.limits")
    assert entry.actor_user == membership.user and entry.after["monthly_spend_limit"] == "12.50"
    assert "of $12.50 budget" in response.content.decode()
    new, _ = api_key_rotate(actor=Actor.system(), key=key, grace=__import__("datetime").timedelta(0))
    assert (new.monthly_spend_limit, new.requests_per_minute) == (Decimal("12.50"), 30)


def test_a_developer_can_not_set_a_keys_budget_and_bad_values_are_refused(tenant, member_of):
    developer, _ = member_of(tenant, "developer")
    key, _ = api_key_create(actor=Actor.system(), tenant=tenant, name="svc", scopes=["inference"])
    assert developer.post(_limits_url(tenant, key), {"monthly_spend_limit": "1"}).status_code == 403
    admin, _ = member_of(tenant, "admin")
    response = admin.post(_limits_url(tenant, key), {"monthly_spend_limit": "-1", "requests_per_minute": "0"},
                          follow=True)  # fmt: skip
    assert "Monthly budget ($)" in response.content.decode()
    key.refresh_from_db()
    assert key.monthly_spend_limit is None and key.requests_per_minute is None


def test_the_api_sets_and_shows_a_keys_limits(tenant):
    admin_key, secret = make_key(tenant)
    target, _ = api_key_create(actor=Actor.system(), tenant=tenant, name="svc", scopes=["inference"])
    api = client_for_key(secret)
    response = api.put(f"/api/v1/keys/{target.prefix}/limits", {"monthly_spend_limit": "5.00",
                                                                 "tokens_per_minute": 1000}, content_type="application/json")  # fmt: skip
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["monthly_spend_limit"], body["requests_per_minute"], body["tokens_per_minute"]) == ("5.00", None, 1000)
    refused = api.put(f"/api/v1/keys/{target.prefix}/limits", {"tokens_per_minute": 0}, content_type="application/json")
    assert refused.status_code == 400 and "tokens_per_minute" in str(refused.json()["error"])
    assert ApiKey.objects.get(pk=target.pk).tokens_per_minute == 1000
