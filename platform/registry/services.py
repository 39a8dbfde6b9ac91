"""Creating adapters and their versions from uploads, and deleting adapters. Each action is atomic and audited.

An upload is copied to storage before the transaction (so the worker can read it) and removed again if the
transaction refuses it; validation runs in the worker, enqueued on commit.
"""

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.files import File
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from registry import signals, tasks
from registry.broadcast import status_changed_on_commit
from registry.errors import PlanLimitReached, RegistryRefusal, UploadTooLarge
from registry.models import Adapter, AdapterVersion, BaseModel, model_name_validator
from registry.promotion import adapter_lock
from registry.selectors import adapter_get, adapters_of, base_models_active
from registry.storage import upload_delete, upload_store
from registry.upload_checks import CheckedUpload, upload_check
from tenancy.audit import Actor, audit_record
from tenancy.models import Tenant


def human_bytes(count: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def upload_limit(*, tenant: Tenant) -> int:
    """Bytes one adapter upload may hold: the tenant's plan cap, never more than the platform's global cap."""
    return min(tenant.plan.max_adapter_bytes, settings.QUILT_MAX_UPLOAD_BYTES)


def upload_refusal(*, tenant: Tenant, size: int | None = None) -> UploadTooLarge:
    limit = upload_limit(tenant=tenant)
    whose = f"your plan ({tenant.plan.name})" if limit == tenant.plan.max_adapter_bytes else "this platform"
    told = f"The upload is {human_bytes(size)}; " if size is not None else "The upload is too large; "
    return UploadTooLarge(
        f"{told}{whose} allows at most {human_bytes(limit)} per adapter.", code="adapter_too_large"
    )


def _check_upload(*, tenant: Tenant, base: BaseModel, files: list[File]) -> tuple[int, CheckedUpload]:
    if not files:
        raise RegistryRefusal(
            "Attach the adapter as 'file': a .zip or .tar.gz of the PEFT folder, or its files one by one.",
            code="file_missing", status_code=400,
        )
    size = sum(upload.size for upload in files)
    if size > upload_limit(tenant=tenant):
        raise upload_refusal(tenant=tenant, size=size)
    if size == 0:
        raise RegistryRefusal("The uploaded file is empty.", code="file_empty")
    return size, upload_check(files=files, base_config=base.config)


def _check_not_a_repeat(*, adapter: Adapter, checked: CheckedUpload) -> None:
    """The same bytes as a version that is (or will be) ready: say so instead of spending a version number."""
    same = (
        adapter.versions.filter(upload_sha256=checked.sha256)
        .exclude(status=AdapterVersion.Status.FAILED)
        .order_by("-number")
        .first()
    )
    if same is not None:
        raise RegistryRefusal(
            f"This upload is identical to version {same.number} of {adapter.name} (same content digest "
            f"{checked.sha256[:12]}); nothing new was created.",
            code="identical_upload", status_code=409,
        )  # fmt: skip


def _check_name(*, name: str) -> None:
    try:
        model_name_validator(name)
    except ValidationError as error:
        raise RegistryRefusal(
            f"'{name}' is not a valid adapter name. {error.messages[0]}", code="invalid_name", status_code=400
        ) from None
    if len(name) > Adapter._meta.get_field("name").max_length:
        raise RegistryRefusal("An adapter name has at most 64 characters.", code="invalid_name", status_code=400)
    if BaseModel.objects.filter(name=name).exists():
        raise RegistryRefusal(f"'{name}' is the name of a base model; pick another.", code="adapter_exists", status_code=409)


def _check_room(*, tenant: Tenant) -> None:
    limit = tenant.plan.max_adapters
    if adapters_of(tenant=tenant).count() >= limit:
        raise PlanLimitReached(
            f"Your plan ({tenant.plan.name}) allows {limit} adapters; delete one or move to a larger plan.",
            code="adapter_limit_reached",
        )


def _check_free(*, tenant: Tenant, name: str) -> None:
    if adapter_get(tenant=tenant, name=name) is not None:
        raise RegistryRefusal(
            f"An adapter named '{name}' already exists; upload a new version to it instead.",
            code="adapter_exists", status_code=409,
        )  # fmt: skip


def _new_version(
    *, adapter: Adapter, number: int, upload_key: str, size: int, sha256: str, actor: Actor, enqueue: bool
) -> AdapterVersion:
    version = AdapterVersion.objects.create(
        adapter=adapter, number=number, upload_key=upload_key, upload_bytes=size, upload_sha256=sha256,
        created_by=actor.user,
    )  # fmt: skip
    status_changed_on_commit(version)
    if enqueue:
        transaction.on_commit(lambda: tasks.validate_adapter_version.delay(version.pk), robust=True)
    return version


def _version_snapshot(version: AdapterVersion) -> dict:
    return {"version": version.number, "upload_bytes": version.upload_bytes, "status": version.status}


def adapter_create(
    *, actor: Actor, tenant: Tenant, name: str, base_model: str, files: list[File], description: str = "",
    enqueue: bool = True,
) -> Adapter:
    """A new adapter with its first version `uploaded`; the worker validates it (unless enqueue=False)."""
    _check_name(name=name)
    base = base_models_active().filter(name=base_model).first()
    if base is None:
        raise RegistryRefusal(f"There is no base model named '{base_model}'.", code="unknown_base_model")
    _check_room(tenant=tenant)
    _check_free(tenant=tenant, name=name)
    size, checked = _check_upload(tenant=tenant, base=base, files=files)
    upload_key = upload_store(files=files)
    try:
        with transaction.atomic():
            tenant = Tenant.objects.select_for_update().select_related("plan").get(pk=tenant.pk)
            _check_room(tenant=tenant)
            _check_free(tenant=tenant, name=name)
            adapter = Adapter.objects.create(
                tenant=tenant, name=name, base_model=base, description=description, created_by=actor.user
            )
            version = _new_version(
                adapter=adapter, number=1, upload_key=upload_key, size=size, sha256=checked.sha256, actor=actor,
                enqueue=enqueue,
            )  # fmt: skip
            audit_record(
                actor=actor, action="adapter.create", target=adapter, tenant=tenant,
                after={"name": name, "base_model": base.name, **_version_snapshot(version)},
            )  # fmt: skip
    except BaseException:
        upload_delete(key=upload_key)
        raise
    return adapter


def adapter_version_create(
    *, actor: Actor, adapter: Adapter, files: list[File], enqueue: bool = True
) -> AdapterVersion:
    """The adapter's next version (numbers count up from 1 and are never reused), `uploaded`.

    Refused before anything is stored: a file the adapter checks refuse, or the same bytes as a live version."""
    size, checked = _check_upload(tenant=adapter.tenant, base=adapter.base_model, files=files)
    _check_not_a_repeat(adapter=adapter, checked=checked)
    upload_key = upload_store(files=files)
    try:
        with transaction.atomic():
            adapter = adapter_lock(adapter)
            _check_not_a_repeat(adapter=adapter, checked=checked)
            number = (adapter.versions.aggregate(top=Max("number"))["top"] or 0) + 1
            version = _new_version(
                adapter=adapter, number=number, upload_key=upload_key, size=size, sha256=checked.sha256, actor=actor,
                enqueue=enqueue,
            )  # fmt: skip
            audit_record(
                actor=actor, action="adapter_version.create", target=version, tenant=adapter.tenant,
                after={"adapter": adapter.name, **_version_snapshot(version)},
            )  # fmt: skip
    except BaseException:
        upload_delete(key=upload_key)
        raise
    return version


def adapter_delete(*, actor: Actor, adapter: Adapter) -> None:
    """The alias stops resolving at once and its name is free again; blobs go once nothing references them."""
    with transaction.atomic():
        adapter = adapter_lock(adapter)
        adapter.deleted_at = timezone.now()
        adapter.save(update_fields=["deleted_at"])
        current = adapter.current_version
        audit_record(
            actor=actor, action="adapter.delete", target=adapter, tenant=adapter.tenant,
            before={"name": adapter.name, "current_version": current.number if current else None},
        )  # fmt: skip


def adapter_warm_set(*, actor: Actor, adapter: Adapter, tier: str) -> Adapter:
    """Pin the adapter always-warm in `tier` ("host" or "gpu") on every engine, or stop pinning it (""); its plan's
    `max_warm_adapters` bounds how many of a tenant's adapters are pinned this way. The engines are told after the
    commit (signals.adapter_warm_changed); one whose budget cannot hold the pin refuses it, and the console shows that."""
    with transaction.atomic():
        adapter = adapter_lock(adapter)
        before = adapter.warm_tier
        if tier and not before:
            limit = adapter.tenant.plan.max_warm_adapters
            pinned = adapters_of(tenant=adapter.tenant).exclude(warm_tier="").count()
            if pinned >= limit:
                raise PlanLimitReached(f"Your plan lets {limit} adapter(s) be pinned always-warm; {pinned} are.",
                                       code="warm_adapter_limit")  # fmt: skip
        adapter.warm_tier = tier
        adapter.save(update_fields=["warm_tier"])
        audit_record(actor=actor, action="adapter.warm", target=adapter, tenant=adapter.tenant,
                     before={"warm_tier": before}, after={"warm_tier": tier})  # fmt: skip
        transaction.on_commit(lambda: signals.adapter_warm_changed.send(sender=Adapter, adapter=adapter))
    return adapter

