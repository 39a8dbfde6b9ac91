import os
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand
from django.db import transaction
from django.utils import timezone

from apikeys.models import Scope
from apikeys.selectors import api_keys_of
from apikeys.services import api_key_create
from registry.selectors import adapter_get, base_models_active
from tenancy.audit import Actor
from tenancy.models import Membership, Plan, Tenant
from tenancy.services import member_add, tenant_create

DEMO_TENANT = "demo"
DEMO_BASE_MODEL = "quilt-demo"
DEMO_ADAPTERS = ("shout", "reverse", "count", "extract")  # each a folder under <demo model>/adapters/
STAFF_USERNAME = "admin"
STAFF_PASSWORD = "quilt-demo-admin"
MEMBER_USERNAME = "dana"
MEMBER_PASSWORD = "quilt-demo-dana"


DEMO_KEY_NAME = "demo"
DEMO_SCOPES = [Scope.INFERENCE, Scope.ADAPTERS_WRITE, Scope.USAGE_READ, Scope.ADMIN]


@dataclass(frozen=True)
class DemoSeed:
    tenant: Tenant
    api_key: str
    adapters: list[str]
    key_reused: bool = False


def demo_key_file() -> Path:
    """Where the demo keeps its key's secret between runs (owner-only file under var/), so a restart reuses the
    key instead of minting another full-scope one. Quilt itself stores only the key's hash."""
    return Path(settings.VAR_DIR) / "demo-api-key"


def _stored_demo_key(tenant: Tenant) -> str | None:
    try:
        secret = demo_key_file().read_text().strip()
    except OSError:
        return None
    key = api_keys_of(tenant=tenant).filter(prefix=secret.partition(".")[0], name=DEMO_KEY_NAME).first()
    usable = key is not None and key.is_valid(secret) and not key.revoked
    if usable and key.expiry_date is not None:
        usable = key.expiry_date > timezone.now()
    return secret if usable else None


def _store_demo_key(secret: str) -> None:
    path = demo_key_file()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(secret + "\n")


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
        plaintext = _stored_demo_key(tenant)
        reused = plaintext is not None
        if not reused:
            _, plaintext = api_key_create(actor=Actor.system(), tenant=tenant, name=DEMO_KEY_NAME, scopes=DEMO_SCOPES)
            _store_demo_key(plaintext)
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
    seed = DemoSeed(tenant=tenant, api_key=plaintext, adapters=adapters, key_reused=reused)
    log(credentials(seed))
    return seed


def credentials(seed: DemoSeed) -> str:
    kept = f"the same as last run, kept in {demo_key_file()}" if seed.key_reused else f"new; kept in {demo_key_file()}"
    return "\n".join([
        f"staff user:   {STAFF_USERNAME} / {STAFF_PASSWORD}",
        f"tenant owner: {MEMBER_USERNAME} / {MEMBER_PASSWORD} (tenant {DEMO_TENANT})",
        f"API key:      {seed.api_key}  ({kept})",
    ])


class Command(BaseCommand):
    help = (
        "Seed the demo: a staff user, a tenant on the starter plan with an owner, a fresh API key (printed) and, "
        "given the demo model folder, its base model and adapters."
    )

    def add_arguments(self, parser):
        parser.add_argument("--model-dir", type=Path, default=None, help="What `python -m engine.demo` built.")

    def handle(self, *args, model_dir, **options):
        seed_demo(model_dir=model_dir, log=self.stdout.write)
