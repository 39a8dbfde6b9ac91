import importlib

import factory
from django.apps import apps
from django.contrib.auth import get_user_model

from apikeys.models import ApiKey, Scope
from tenancy.models import Membership, Plan, Tenant

DEFAULT_PLANS = importlib.import_module("tenancy.migrations.0002_default_plans")


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()

    username = factory.Sequence(lambda n: f"user{n}")
    email = factory.LazyAttribute(lambda user: f"{user.username}@example.test")
    password = factory.django.Password("pw-12345-secret")


def default_plan() -> Plan:
    """The starter plan from the data migration. A flush (a transactional test's, a process stack's at its end)
    empties the table; the migration's plans are then made again as the migration makes them, prices included, so
    that a test run after a flush bills as one run before it (under xdist a worker meets flushes in any order)."""
    if not Plan.objects.filter(slug="starter").exists():
        DEFAULT_PLANS.create_plans(apps, None)
    return Plan.objects.get(slug="starter")


class TenantFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Tenant

    slug = factory.Sequence(lambda n: f"tenant-{n}")
    name = factory.LazyAttribute(lambda tenant: tenant.slug.title())
    plan = factory.LazyFunction(lambda: default_plan())


class MembershipFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Membership

    user = factory.SubFactory(UserFactory)
    tenant = factory.SubFactory(TenantFactory)
    role = Membership.Role.DEVELOPER


def make_key(tenant: Tenant, scopes=(Scope.ADMIN,), **fields) -> tuple[ApiKey, str]:
    return ApiKey.objects.create_key(tenant=tenant, name=fields.pop("name", "test"), scopes=list(scopes), **fields)
