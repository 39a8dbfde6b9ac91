from contextlib import ExitStack
from pathlib import Path

from django.core.files import File
from django.core.management.base import BaseCommand, CommandError

from registry import services
from registry.errors import RegistryRefusal
from registry.selectors import adapter_get, base_models_active
from registry.validation import adapter_version_validate
from tenancy.audit import Actor
from tenancy.models import Tenant


class Command(BaseCommand):
    help = (
        "Import a PEFT adapter (folder, .zip or .tar.gz) for a tenant and validate it now: a new adapter, "
        "or the next version of an existing one."
    )

    def add_arguments(self, parser):
        parser.add_argument("tenant", help="Tenant slug.")
        parser.add_argument("name", help="Adapter name (the alias clients use).")
        parser.add_argument("path")
        parser.add_argument("--base-model", default="", help="Needed for a new adapter when several are registered.")
        parser.add_argument("--description", default="")

    def handle(self, *args, tenant, name, path, base_model, description, **options):
        owner = Tenant.objects.select_related("plan").filter(slug=tenant).first()
        if owner is None:
            raise CommandError(f"No tenant {tenant!r}.")
        source = Path(path)
        if not source.exists():
            raise CommandError(f"{source} does not exist.")
        paths = sorted(p for p in source.iterdir() if p.is_file()) if source.is_dir() else [source]
        actor = Actor.system()
        with ExitStack() as stack:
            files = [File(stack.enter_context(open(p, "rb")), name=p.name) for p in paths]
            try:
                version = self._upload(owner, name, base_model, description, files, actor)
            except RegistryRefusal as refusal:
                raise CommandError(refusal.message) from None
        version = adapter_version_validate(version_id=version.pk)
        if not version.is_ready:
            raise CommandError(f"{name}@{version.number} failed validation: {version.failure_message}")
        self.stdout.write(f"{name}@{version.number} ready: rank {version.rank}, digest {version.digest}")

    def _upload(self, tenant, name, base_model, description, files, actor):
        adapter = adapter_get(tenant=tenant, name=name)
        if adapter is not None:
            return services.adapter_version_create(actor=actor, adapter=adapter, files=files, enqueue=False)
        if not base_model:
            names = list(base_models_active().values_list("name", flat=True))
            if len(names) != 1:
                raise CommandError(f"Name the base model with --base-model (registered: {', '.join(names) or 'none'}).")
            base_model = names[0]
        adapter = services.adapter_create(
            actor=actor, tenant=tenant, name=name, base_model=base_model, description=description, files=files,
            enqueue=False,
        )  # fmt: skip
        return adapter.versions.get(number=1)
