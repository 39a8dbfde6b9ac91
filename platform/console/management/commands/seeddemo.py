from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

from apikeys.models import Scope
from apikeys.services import api_key_create
from tenancy.audit import Actor
from tenancy.models import Membership, Plan, Tenant
from tenancy.services import member_add, tenant_create

DEMO_TENANT = "demo"
STAFF_USERNAME = "admin"
STAFF_PASSWORD = "quilt-demo-admin"
MEMBER_USERNAME = "dana"
MEMBER_PASSWORD = "quilt-demo-dana"


class Command(BaseCommand):
    help = "Seed the demo: a staff user, a tenant on the starter plan with an owner, and a fresh API key (printed)."

    def handle(self, *args, **options):
        User = get_user_model()
        with transaction.atomic():
            if not User.objects.filter(username=STAFF_USERNAME).exists():
                User.objects.create_superuser(STAFF_USERNAME, "admin@quilt.local", STAFF_PASSWORD)
            tenant = Tenant.objects.filter(slug=DEMO_TENANT).first()
            if tenant is None:
                tenant = tenant_create(
                    actor=Actor.system(), slug=DEMO_TENANT, name="Demo Co", plan=Plan.objects.get(slug="starter")
                )
            if not User.objects.filter(username=MEMBER_USERNAME).exists():
                User.objects.create_user(MEMBER_USERNAME, "dana@demo.quilt.local", MEMBER_PASSWORD)
                member_add(actor=Actor.system(), tenant=tenant, role=Membership.Role.OWNER, username=MEMBER_USERNAME)
            _, plaintext = api_key_create(
                actor=Actor.system(), tenant=tenant, name="demo",
                scopes=[Scope.INFERENCE, Scope.ADAPTERS_WRITE, Scope.USAGE_READ, Scope.ADMIN],
            )  # fmt: skip
        self.stdout.write(f"staff user:   {STAFF_USERNAME} / {STAFF_PASSWORD}")
        self.stdout.write(f"tenant owner: {MEMBER_USERNAME} / {MEMBER_PASSWORD} (tenant {DEMO_TENANT})")
        self.stdout.write(f"API key (shown once): {plaintext}")
