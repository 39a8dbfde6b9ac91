"""Hot-swap: pointing an adapter's alias at a ready version, and rolling back to the one before.

The adapter row is locked for the whole action, so concurrent promotes serialize and the alias always
equals the top of its promotion stack. Requests already running keep the version they resolved.
"""

from django.db import transaction
from django.utils import timezone

from registry.broadcast import promoted_on_commit
from registry.errors import RegistryRefusal
from registry.models import Adapter, AdapterPromotion, AdapterVersion
from tenancy.audit import Actor, audit_record


def adapter_lock(adapter: Adapter) -> Adapter:
    """The adapter's row, locked for this transaction; refused (404) once it has been deleted."""
    found = Adapter.objects.select_for_update().filter(pk=adapter.pk, deleted_at__isnull=True).first()
    if found is None:
        raise RegistryRefusal(f"The adapter '{adapter.name}' does not exist.", code="not_found", status_code=404)
    return found


def _number(version: AdapterVersion | None) -> int | None:
    return version.number if version is not None else None


def promote_locked(*, actor: Actor, adapter: Adapter, version: AdapterVersion, automatic: bool = False) -> None:
    """Promotes inside the caller's transaction; `adapter` must be locked (select_for_update) by it."""
    previous = adapter.current_version
    AdapterPromotion.objects.create(adapter=adapter, version=version, promoted_by=actor.user)
    adapter.current_version = version
    adapter.save(update_fields=["current_version"])
    audit_record(
        actor=actor, action="adapter.promote", target=adapter, tenant=adapter.tenant,
        before={"version": _number(previous)}, after={"version": version.number, "automatic": automatic},
    )  # fmt: skip
    promoted_on_commit(adapter=adapter, version=version, previous=previous)


def adapter_promote(*, actor: Actor, adapter: Adapter, version_number: int) -> Adapter:
    with transaction.atomic():
        adapter = adapter_lock(adapter)
        version = adapter.versions.filter(number=version_number).first()
        if version is None:
            raise RegistryRefusal(
                f"The adapter '{adapter.name}' has no version {version_number}.", code="version_not_found",
                status_code=404,
            )  # fmt: skip
        if not version.is_ready:
            raise RegistryRefusal(
                f"Version {version_number} is {version.status}; only a ready version can be promoted.",
                code="version_not_ready", status_code=409,
            )  # fmt: skip
        if adapter.current_version_id == version.pk:
            raise RegistryRefusal(
                f"Version {version_number} is already the current version.", code="already_current", status_code=409
            )
        promote_locked(actor=actor, adapter=adapter, version=version)
    return adapter


def adapter_rollback(*, actor: Actor, adapter: Adapter) -> Adapter:
    """Back to the version promoted before the current one; rolling back again goes further back."""
    with transaction.atomic():
        adapter = adapter_lock(adapter)
        live = list(
            adapter.promotions.filter(rolled_back_at__isnull=True).select_related("version").order_by("-id")[:2]
        )
        if len(live) < 2:
            raise RegistryRefusal(
                f"The adapter '{adapter.name}' has no earlier promoted version to roll back to.",
                code="nothing_to_roll_back", status_code=409,
            )  # fmt: skip
        current, target = live
        current.rolled_back_at = timezone.now()
        current.save(update_fields=["rolled_back_at"])
        previous = adapter.current_version
        adapter.current_version = target.version
        adapter.save(update_fields=["current_version"])
        audit_record(
            actor=actor, action="adapter.rollback", target=adapter, tenant=adapter.tenant,
            before={"version": _number(previous)}, after={"version": target.version.number},
        )  # fmt: skip
        promoted_on_commit(adapter=adapter, version=target.version, previous=previous)
    return adapter
