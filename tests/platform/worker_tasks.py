"""A task only the tests register (via `celery worker --include`), to prove the worker reaches the database."""

from celery import shared_task

from tenancy.audit import Actor
from tenancy.models import Plan
from tenancy.services import tenant_create


@shared_task(name="tests.create_tenant")
def create_tenant(slug: str) -> None:
    plan, _ = Plan.objects.get_or_create(slug="starter", defaults={"name": "Starter"})
    tenant_create(actor=Actor.system(), slug=slug, name=slug, plan=plan)
