"""Plans through the staff API: a price is money a tenant pays per million tokens, so never below zero."""

from decimal import Decimal

import pytest
from rest_framework.test import APIClient

from tenancy.models import Plan
from tests.platform.factories import UserFactory

pytestmark = pytest.mark.django_db

PRICES = ["price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok", "price_training_per_mtok"]


@pytest.fixture
def staff():
    client = APIClient()
    client.force_login(UserFactory(is_staff=True), backend="django.contrib.auth.backends.ModelBackend")
    return client


@pytest.mark.parametrize("price", PRICES)
def test_a_negative_price_is_refused(staff, price):
    created = staff.post("/api/v1/plans", {"slug": "cheap", "name": "Cheap", price: "-0.50"}, format="json")
    assert created.status_code == 400 and price in created.json()["error"]["message"]
    assert not Plan.objects.filter(slug="cheap").exists()
    staff.post("/api/v1/plans", {"slug": "fair", "name": "Fair", price: "2.50"}, format="json")
    changed = staff.patch("/api/v1/plans/fair", {price: "-1"}, format="json")
    assert changed.status_code == 400 and price in changed.json()["error"]["message"]
    assert getattr(Plan.objects.get(slug="fair"), price) == Decimal("2.50")


def test_prices_are_decimal_strings(staff):
    created = staff.post("/api/v1/plans", {"slug": "fair", "name": "Fair", "price_output_per_mtok": "0.1"},
                         format="json")  # fmt: skip
    assert created.status_code == 201 and created.json()["price_output_per_mtok"] == "0.100000"
    assert staff.get("/api/v1/plans/fair").json()["price_input_per_mtok"] == "0.000000"
