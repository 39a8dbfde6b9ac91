from decimal import Decimal

from django.db import migrations

DEFAULT_PLANS = [
    dict(
        slug="free", name="Free", requests_per_minute=20, tokens_per_minute=20_000, max_concurrent_requests=2,
        monthly_token_budget=1_000_000, monthly_spend_limit=None, max_adapters=3, max_adapter_bytes=64 * 1024**2,
        default_max_tokens=256, scheduling_weight=Decimal("0.50"), price_input_per_mtok=Decimal("0"),
        price_cached_input_per_mtok=Decimal("0"), price_output_per_mtok=Decimal("0"),
    ),
    dict(
        slug="starter", name="Starter", requests_per_minute=120, tokens_per_minute=200_000, max_concurrent_requests=8,
        monthly_token_budget=50_000_000, monthly_spend_limit=Decimal("500.00"), max_adapters=10,
        max_adapter_bytes=256 * 1024**2, default_max_tokens=512, scheduling_weight=Decimal("1.00"),
        price_input_per_mtok=Decimal("0.20"), price_cached_input_per_mtok=Decimal("0.05"),
        price_output_per_mtok=Decimal("0.60"),
    ),
    dict(
        slug="scale", name="Scale", requests_per_minute=1200, tokens_per_minute=2_000_000,
        max_concurrent_requests=64, monthly_token_budget=None, monthly_spend_limit=Decimal("20000.00"),
        max_adapters=200, max_adapter_bytes=1024**3, default_max_tokens=1024, scheduling_weight=Decimal("4.00"),
        price_input_per_mtok=Decimal("0.15"), price_cached_input_per_mtok=Decimal("0.03"),
        price_output_per_mtok=Decimal("0.45"),
    ),
]  # fmt: skip


def create_plans(apps, schema_editor):
    Plan = apps.get_model("tenancy", "Plan")
    for fields in DEFAULT_PLANS:
        Plan.objects.update_or_create(slug=fields["slug"], defaults=fields)


def remove_plans(apps, schema_editor):
    apps.get_model("tenancy", "Plan").objects.filter(slug__in=[plan["slug"] for plan in DEFAULT_PLANS]).delete()


class Migration(migrations.Migration):
    dependencies = [("tenancy", "0001_initial")]
    operations = [migrations.RunPython(create_plans, remove_plans)]
