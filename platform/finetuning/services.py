"""Uploading and deleting fine-tuning files; creating and cancelling jobs. Each action is atomic and audited.

Files are checked line by line when uploaded (JSON, shape, roles, empty messages) and again, against the base
model's chat template and context, when a job is created: a job only starts on data it can train on. The
training itself runs in the `training` queue's worker, enqueued on commit.
"""

import secrets

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from apikeys.models import ApiKey
from finetuning import events, storage, tasks
from finetuning.data import examples_encode
from finetuning.errors import FineTuningRefusal, not_found
from finetuning.hyperparameters import hyperparameters_resolve
from finetuning.models import FineTuningJob, TrainingFile
from finetuning.selectors import file_get, files_of, jobs_active
from registry.models import model_name_validator
from registry.selectors import adapter_get, adapters_of, base_models_active
from tenancy.audit import Actor, audit_record
from tenancy.models import Tenant
from training import dataset
from training.steps import Hyperparameters, total_steps

PURPOSE = "fine-tune"
MAX_SUFFIX = 64


def _actor(key_id) -> Actor:
    """The key the request came with (an ApiKey's primary key is its id string, "prefix.hash")."""
    return Actor(key=ApiKey.objects.filter(pk=key_id).first() if key_id else None)


# -- files --------------------------------------------------------------------------------------------------------

def file_create(*, tenant: Tenant, key_id, filename: str, content: bytes, purpose: str) -> TrainingFile:
    if purpose != PURPOSE:
        raise FineTuningRefusal(
            f"Only files with purpose '{PURPOSE}' can be uploaded here; got '{purpose}'.", code="invalid_purpose",
            param="purpose",
        )  # fmt: skip
    if len(content) > settings.QUILT_FINE_TUNING_MAX_FILE_BYTES:
        raise FineTuningRefusal(
            f"The file is {len(content)} bytes; at most {settings.QUILT_FINE_TUNING_MAX_FILE_BYTES} are accepted.",
            code="file_too_large", status=413, param="file",
        )  # fmt: skip
    if not filename.lower().endswith(".jsonl"):
        raise FineTuningRefusal("A fine-tuning file must be a .jsonl file.", code="invalid_file_format", param="file")
    try:
        method, examples = dataset.parse(content)
    except dataset.DatasetInvalid as invalid:
        raise FineTuningRefusal(
            f"Invalid file format for fine-tuning: {invalid.message}", code="invalid_file_format", param="file"
        ) from None
    key = storage.file_store(content=content)
    try:
        with transaction.atomic():
            _storage_quota_check(tenant=tenant, adding=len(content))
            uploaded = TrainingFile.objects.create(
                tenant=tenant, filename=filename[:255], purpose=purpose, bytes=len(content), storage_key=key,
                method=method, examples=len(examples),
            )  # fmt: skip
            audit_record(
                actor=_actor(key_id), action="fine_tuning_file.create", target=uploaded, tenant=tenant,
                after={"id": uploaded.public_id, "filename": uploaded.filename, "bytes": uploaded.bytes,
                       "method": method, "examples": len(examples)},
            )  # fmt: skip
    except BaseException:
        storage.file_remove(key=key)
        raise
    return uploaded


def _storage_quota_check(*, tenant: Tenant, adding: int) -> None:
    """The plan's bound on the tenant's files together, checked under a lock on the tenant's row so that uploads at
    once can't each fit alone and overflow together. Inside the upload's transaction."""
    Tenant.objects.select_for_update().filter(pk=tenant.pk).first()
    stored = files_of(tenant=tenant).aggregate(total=Sum("bytes"))["total"] or 0
    quota = tenant.plan.max_file_storage_bytes
    if stored + adding > quota:
        raise FineTuningRefusal(
            f"This file ({adding} bytes) would bring your stored files to {stored + adding} bytes; your plan "
            f"({tenant.plan.name}) stores at most {quota}. Delete files you no longer need, or ask for a larger plan.",
            code="file_storage_quota_exceeded", status=403, param="file",
        )  # fmt: skip


def file_delete(*, tenant: Tenant, key_id, public_id: str) -> TrainingFile:
    with transaction.atomic():
        uploaded = file_get(tenant=tenant, public_id=public_id)
        if uploaded is None:
            raise not_found("file", public_id)
        uploaded = TrainingFile.objects.select_for_update().get(pk=uploaded.pk)
        in_use = jobs_active().filter(tenant=tenant).filter(training_file=uploaded).exists() or (
            jobs_active().filter(tenant=tenant, validation_file=uploaded).exists()
        )
        if in_use:
            raise FineTuningRefusal(
                "A running fine-tuning job uses this file; cancel it or wait for it to finish.", code="file_in_use",
                status=409,
            )  # fmt: skip
        uploaded.deleted_at = timezone.now()
        uploaded.save(update_fields=["deleted_at"])
        audit_record(actor=_actor(key_id), action="fine_tuning_file.delete", target=uploaded, tenant=tenant,
                     before={"id": uploaded.public_id, "filename": uploaded.filename})  # fmt: skip
        key = uploaded.storage_key
        transaction.on_commit(lambda: storage.file_remove(key=key), robust=True)
    return uploaded


# -- jobs ---------------------------------------------------------------------------------------------------------

def _method(method: dict | None, hyperparameters: dict | None) -> tuple[str, dict | None, str]:
    """(type, the hyperparameters given, their parameter name) from OpenAI's `method` or the older top level."""
    if method is None:
        return dataset.SUPERVISED, hyperparameters, "hyperparameters"
    if not isinstance(method, dict) or method.get("type") not in dataset.METHODS:
        raise FineTuningRefusal(
            f"method.type must be one of {', '.join(dataset.METHODS)}.", code="unsupported_method", param="method.type"
        )
    kind = method["type"]
    options = method.get(kind) or {}
    if not isinstance(options, dict):
        raise FineTuningRefusal(f"method.{kind} must be an object.", code="invalid_request", param=f"method.{kind}")
    given = options.get("hyperparameters")
    if given is None and kind == dataset.SUPERVISED:
        given = hyperparameters
    return kind, given, f"method.{kind}.hyperparameters"


def _suffix(*, tenant: Tenant, suffix: str | None) -> str:
    if suffix in (None, ""):
        return f"ft-{secrets.token_hex(4)}"
    if not isinstance(suffix, str) or len(suffix) > MAX_SUFFIX:
        raise FineTuningRefusal(f"suffix must be a string of at most {MAX_SUFFIX} characters.",
                                code="invalid_suffix", param="suffix")  # fmt: skip
    try:
        model_name_validator(suffix)
    except ValidationError as error:
        raise FineTuningRefusal(f"suffix '{suffix}' can't name a model. {error.messages[0]}",
                                code="invalid_suffix", param="suffix") from None  # fmt: skip
    if base_models_active().filter(name=suffix).exists():
        raise FineTuningRefusal(f"'{suffix}' is the name of a base model; pick another suffix.",
                                code="invalid_suffix", param="suffix")  # fmt: skip
    return suffix


def _check_room(*, tenant: Tenant, suffix: str) -> None:
    if adapter_get(tenant=tenant, name=suffix) is None and adapters_of(tenant=tenant).count() >= tenant.plan.max_adapters:
        raise FineTuningRefusal(
            f"Your plan ({tenant.plan.name}) allows {tenant.plan.max_adapters} adapters, and a job with a new suffix "
            "makes one more; delete an adapter or reuse an existing adapter's name as the suffix.",
            code="adapter_limit_reached", status=403, param="suffix",
        )  # fmt: skip


def _check_concurrency(*, tenant: Tenant) -> None:
    limit = tenant.plan.max_concurrent_fine_tuning_jobs
    if jobs_active().filter(tenant=tenant).count() >= limit:
        raise FineTuningRefusal(
            f"Your plan ({tenant.plan.name}) runs at most {limit} fine-tuning job(s) at a time; wait for one to "
            "finish or cancel it.", code="fine_tuning_job_limit_reached", status=429,
        )  # fmt: skip


def _data(*, tenant: Tenant, public_id: str | None, param: str, method: str, base, minimum: int):
    named = isinstance(public_id, str) and "\x00" not in public_id  # no id holds a NUL; PostgreSQL refuses one
    uploaded = file_get(tenant=tenant, public_id=public_id) if named else None
    if uploaded is None:
        raise not_found("file", str(public_id), param=param)
    try:
        encoded = examples_encode(uploaded=uploaded, method=method, checkpoint_dir=base.checkpoint_dir,
                                  max_context=base.max_context, minimum=minimum)  # fmt: skip
    except dataset.DatasetInvalid as invalid:
        raise FineTuningRefusal(f"The {param} {uploaded.public_id} can't be used for {method} fine-tuning: "
                                f"{invalid.message}", code=f"invalid_{param}", param=param) from None  # fmt: skip
    return uploaded, encoded


def job_create(
    *, tenant: Tenant, key_id, model: str, training_file: str, validation_file: str | None = None,
    method: dict | None = None, hyperparameters: dict | None = None, suffix: str | None = None,
    seed: int | None = None, metadata: dict | None = None,
) -> FineTuningJob:
    base = base_models_active().filter(name=model).first() if isinstance(model, str) else None
    if base is None:
        raise FineTuningRefusal(f"The model '{model}' is not a base model that can be fine-tuned.",
                                code="model_not_found", status=404, param="model")  # fmt: skip
    kind, given, param = _method(method, hyperparameters)
    suffix = _suffix(tenant=tenant, suffix=suffix)
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**31):
        raise FineTuningRefusal("seed must be an integer from 0 to 2147483647.", code="invalid_seed", param="seed")
    _check_concurrency(tenant=tenant)
    _check_room(tenant=tenant, suffix=suffix)
    train_file, train = _data(tenant=tenant, public_id=training_file, param="training_file", method=kind, base=base,
                              minimum=dataset.MIN_EXAMPLES)  # fmt: skip
    valid_file = None
    if validation_file is not None:
        valid_file, _ = _data(tenant=tenant, public_id=validation_file, param="validation_file", method=kind,
                              base=base, minimum=1)  # fmt: skip
    resolved = hyperparameters_resolve(given=given, method=kind, examples=len(train), param=param)
    seed = seed if seed is not None else secrets.randbelow(2**31)
    steps = total_steps(len(train), Hyperparameters(
        n_epochs=resolved["n_epochs"], batch_size=resolved["batch_size"], learning_rate=0.0,
        lora_rank=resolved["lora_rank"], lora_alpha=resolved["lora_alpha"],
    ))  # fmt: skip
    tokens = sum(example.tokens for example in train)
    with transaction.atomic():
        tenant = Tenant.objects.select_for_update().select_related("plan").get(pk=tenant.pk)
        _check_concurrency(tenant=tenant)
        job = FineTuningJob.objects.create(
            tenant=tenant, created_by_key_id=key_id if isinstance(key_id, int) else None, base_model=base,
            training_file=train_file, validation_file=valid_file, method=kind, hyperparameters=resolved,
            suffix=suffix, seed=seed, metadata=metadata, status=FineTuningJob.Status.QUEUED, total_steps=steps,
            price_training_per_mtok=tenant.plan.price_training_per_mtok,
        )  # fmt: skip
        events.job_event(job=job, message=f"Created fine-tuning job: {job.public_id}")
        events.job_event(job=job, message=(
            f"Validated training file {train_file.public_id}: {len(train)} examples, {tokens} tokens; "
            f"{steps} steps over {resolved['n_epochs']} epochs"
        ))  # fmt: skip
        audit_record(
            actor=_actor(key_id), action="fine_tuning_job.create", target=job, tenant=tenant,
            after={"id": job.public_id, "model": base.name, "method": kind, "training_file": train_file.public_id,
                   "suffix": suffix, "hyperparameters": resolved},
        )  # fmt: skip
        job_id = job.pk
        transaction.on_commit(lambda: tasks.job_enqueue(job_id=job_id), robust=True)
    return job


def job_cancel(*, tenant: Tenant, key_id, public_id: str) -> FineTuningJob:
    """Cancelled at once; a trainer running it sees its claim gone at its next step and stops."""
    with transaction.atomic():
        job = FineTuningJob.objects.select_for_update().filter(tenant=tenant, public_id=public_id).first()
        if job is None:
            raise not_found("fine-tuning job", public_id)
        if not job.is_active:
            raise FineTuningRefusal(f"The job is {job.status} and can't be cancelled.", code="job_not_cancellable")
        before = job.status
        job.status = FineTuningJob.Status.CANCELLED
        job.run_token = ""
        job.finished_at = timezone.now()
        job.save(update_fields=["status", "run_token", "finished_at"])
        events.job_event(job=job, message="Job cancelled")
        audit_record(actor=_actor(key_id), action="fine_tuning_job.cancel", target=job, tenant=tenant,
                     before={"status": before}, after={"status": job.status})  # fmt: skip
    return job
