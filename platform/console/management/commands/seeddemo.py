from dataclasses import dataclass
from pathlib import Path

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand
from django.db import transaction

from apikeys.models import Scope
from apikeys.services import api_key_create
from registry.selectors import adapter_get, base_models_active
from tenancy.audit import Actor
from tenancy.models import Membership, Plan, Tenant
from tenancy.services import member_add, tenant_create

DEMO_TENANT = "demo"
DEMO_BASE_MODEL = "quilt-demo"
DEMO_ADAPTERS = ("shout", "reverse", "count")  # each a folder under <demo model>/adapters/
STAFF_USERNAME = "admin"
STAFF_PASSWORD = "quilt-demo-admin"
MEMBER_USERNAME = "dana"
MEMBER_PASSWORD = "quilt-demo-dana"


@dataclass(frozen=True)
class DemoSeed:
    tenant: Tenant
    api_key: str
    adapters: list[str]


def seed_demo(*, model_dir: Path | None = None, log=print) -> DemoSeed:
    """A staff user, a tenant on the starter plan with an owner and a fresh key; with the demo model, its base
    model registered and its adapters imported for the tenant (each step skipped if already done)."""
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
    adapters = []
    if model_dir is not None:
        if not base_models_active().filter(name=DEMO_BASE_MODEL).exists():
            call_command("registerbasemodel", DEMO_BASE_MODEL, str(model_dir))
        for name in DEMO_ADAPTERS:
            path = Path(model_dir) / "adapters" / name
            if adapter_get(tenant=tenant, name=name) is None and path.is_dir():
                call_command("importadapter", DEMO_TENANT, name, str(path), "--base-model", DEMO_BASE_MODEL,
                             "--description", f"demo adapter: {name}")  # fmt: skip
            if adapter_get(tenant=tenant, name=name) is not None:
                adapters.append(name)
    log(f"staff user:   {STAFF_USERNAME} / {STAFF_PASSWORD}")
    log(f"tenant owner: {MEMBER_USERNAME} / {MEMBER_PASSWORD} (tenant {DEMO_TENANT})")
    log(f"API key (shown once): {plaintext}")
    return DemoSeed(tenant=tenant, api_key=plaintext, adapters=adapters)


class Command(BaseCommand):
    help = (
        "Seed the demo: a staff user, a tenant on the starter plan with an owner, a fresh API key (printed) and, "
        "given the demo model folder, its base model and adapters."
    )

    def add_arguments(self, parser):
        parser.add_argument("--model-dir", type=Path, default=None, help="What `python -m engine.demo` built.")

    def handle(self, *args, model_dir, **options):
        seed_demo(model_dir=model_dir, log=self.stdout.write)
