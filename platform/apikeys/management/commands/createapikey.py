from datetime import timedelta

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from apikeys.models import Scope
from apikeys.services import api_key_create
from tenancy.audit import Actor
from tenancy.models import Tenant


class Command(BaseCommand):
    help = "Create an API key for a tenant and print it once (it is not stored and cannot be shown again)."

    def add_arguments(self, parser):
        parser.add_argument("tenant", help="tenant slug")
        parser.add_argument("name")
        parser.add_argument("--scopes", default=Scope.INFERENCE, help=f"comma-separated: {','.join(Scope.values)}")
        parser.add_argument("--models", default="", help="comma-separated allowed models (default: all)")
        parser.add_argument("--expires-in-days", type=int, default=None)

    def handle(self, *args, tenant, name, scopes, models, expires_in_days, **options):
        tenant_obj = Tenant.objects.filter(slug=tenant).first()
        if tenant_obj is None:
            raise CommandError(f"No tenant {tenant!r}.")
        expiry = timezone.now() + timedelta(days=expires_in_days) if expires_in_days else None
        try:
            key, plaintext = api_key_create(
                actor=Actor.system(), tenant=tenant_obj, name=name,
                scopes=[scope.strip() for scope in scopes.split(",") if scope.strip()],
                allowed_models=[model.strip() for model in models.split(",") if model.strip()], expiry_date=expiry,
            )  # fmt: skip
        except ValidationError as error:
            raise CommandError("; ".join(error.messages)) from error
        self.stdout.write(plaintext)
        self.stderr.write(f"Created key {key.prefix} ({key.name}) for {tenant_obj.slug}; this is the only time it is shown.")
