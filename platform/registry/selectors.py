"""Reads over base models and adapters. A tenant only ever sees its own live adapters."""

from dataclasses import dataclass

from django.db.models import QuerySet

from registry.models import Adapter, AdapterVersion, BaseModel
from tenancy.models import Tenant


class ModelNotFound(LookupError):
    """No model of that name is servable for this tenant (other tenants' adapters are never revealed)."""

    def __init__(self, name: str, reason: str = ""):
        self.name = name
        self.message = reason or f"The model '{name}' does not exist or you do not have access to it."
        super().__init__(self.message)


@dataclass(frozen=True)
class ResolvedModel:
    base_model: BaseModel
    adapter: Adapter | None = None
    version: AdapterVersion | None = None

    @property
    def name(self) -> str:
        return self.adapter.name if self.adapter is not None else self.base_model.name


def base_models_active() -> QuerySet[BaseModel]:
    return BaseModel.objects.filter(status=BaseModel.Status.ACTIVE)


def adapters_of(*, tenant: Tenant) -> QuerySet[Adapter]:
    return (
        Adapter.objects.filter(tenant=tenant, deleted_at__isnull=True)
        .select_related("base_model", "current_version")
        .order_by("name")
    )


def adapter_get(*, tenant: Tenant, name: str) -> Adapter | None:
    return adapters_of(tenant=tenant).filter(name=name).first()


def adapter_versions(*, adapter: Adapter) -> QuerySet[AdapterVersion]:
    return AdapterVersion.objects.filter(adapter=adapter).order_by("number")


def adapter_previous_version(*, adapter: Adapter) -> AdapterVersion | None:
    """What a rollback would go back to: the promotion under the current one on the alias's stack."""
    live = adapter.promotions.filter(rolled_back_at__isnull=True).select_related("version").order_by("-id")[:2]
    live = list(live)
    return live[1].version if len(live) == 2 else None


def model_resolve(*, tenant: Tenant, name: str) -> ResolvedModel:
    """`base-name`, `adapter-name` (its current version) or `adapter-name@N` (a pinned ready version)."""
    alias, at, number = name.partition("@")
    if not at:
        base = base_models_active().filter(name=name).first()
        if base is not None:
            return ResolvedModel(base_model=base)
    adapter = adapter_get(tenant=tenant, name=alias)
    if adapter is None or adapter.base_model.status != BaseModel.Status.ACTIVE:
        raise ModelNotFound(name)
    if not at:
        if adapter.current_version is None:
            raise ModelNotFound(name, f"The adapter '{alias}' has no ready version yet.")
        return ResolvedModel(base_model=adapter.base_model, adapter=adapter, version=adapter.current_version)
    if not number.isdigit():
        raise ModelNotFound(name, f"'{name}' is not a valid model: pin a version as '{alias}@<number>'.")
    version = adapter_versions(adapter=adapter).filter(number=int(number)).first()
    if version is None or not version.is_ready:
        raise ModelNotFound(name, f"Version {number} of the adapter '{alias}' is not ready or does not exist.")
    return ResolvedModel(base_model=adapter.base_model, adapter=adapter, version=version)


def models_for_tenant(*, tenant: Tenant) -> list[ResolvedModel]:
    """Every model the tenant can call: the active base models, then its adapters that have a ready version."""
    models = [ResolvedModel(base_model=base) for base in base_models_active()]
    adapters = adapters_of(tenant=tenant).filter(
        current_version__isnull=False, base_model__status=BaseModel.Status.ACTIVE
    )
    models += [
        ResolvedModel(base_model=adapter.base_model, adapter=adapter, version=adapter.current_version)
        for adapter in adapters
    ]
    return models
