import factory
from django.contrib.auth import get_user_model

from apikeys.models import ApiKey, Scope
from tenancy.models import Membership, Plan, Tenant


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()

    username = factory.Sequence(lambda n: f"user{n}")
    email = factory.LazyAttribute(lambda user: f"{user.username}@example.test")
    password = factory.django.Password("pw-12345-secret")


def default_plan() -> Plan:
    """The starter plan from the data migration (recreated if a transactional test flushed it)."""
    return Plan.objects.get_or_create(slug="starter", defaults={"name": "Starter"})[0]


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
