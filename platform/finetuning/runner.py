"""Running a job in the training worker: claim it, train (or resume) it, publish the adapter as a new version.

A claim is a fresh `run_token` on the job, committed before training starts. Every step the trainer renews its
heartbeat only while the job is still running under its token; cancelling (or another trainer taking over a
job whose heartbeat went stale) clears that, and the trainer stops before its next step. A trainer killed
mid-job leaves its last checkpoint: the job's next run (the task delivered again, or the stale-job sweep)
resumes there, and after QUILT_FINE_TUNING_MAX_ATTEMPTS claims that never finished the job fails saying so.
The adapter goes through the registry's own upload and validation path, exactly as an upload would.
"""

import logging
import secrets
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

import torch
from django.conf import settings
from django.core.files import File
from django.db import transaction
from django.utils import timezone

from finetuning import storage
from finetuning.data import examples_encode
from finetuning.events import job_event
from finetuning.hyperparameters import learning_rate
from finetuning.models import FineTuningJob, JobCheckpoint, JobEvent
from registry.errors import RegistryRefusal
from registry.models import AdapterVersion
from registry.selectors import adapter_get
from registry.services import adapter_create, adapter_version_create
from registry.validation import adapter_version_validate
from tenancy.audit import Actor
from training import dataset, trainer
from training.steps import Hyperparameters

logger = logging.getLogger(__name__)
Status = FineTuningJob.Status


def _locked(job_id: int) -> FineTuningJob:
    return FineTuningJob.objects.select_for_update(of=("self",)).select_related("tenant__plan", "base_model").get(
        pk=job_id
    )


def _fail_locked(job: FineTuningJob, *, code: str, message: str) -> None:
    job.status = Status.FAILED
    job.error_code, job.error_message = code, message
    job.run_token = ""
    job.finished_at = timezone.now()
    job.save(update_fields=["status", "error_code", "error_message", "run_token", "finished_at"])
    job_event(job=job, level=JobEvent.Level.ERROR, message=f"Job failed: {message}")
    public_id = job.public_id
    transaction.on_commit(lambda: storage.work_dir_remove(job_public_id=public_id), robust=True)


def _fail(job_id: int, token: str, *, code: str, message: str) -> None:
    with transaction.atomic():
        job = _locked(job_id)
        if job.status == Status.RUNNING and job.run_token == token:
            _fail_locked(job, code=code, message=message)


def _claim(job_id: int) -> tuple[FineTuningJob, str] | None:
    """Marks the job running under a new token (one more attempt); None when there is nothing to do."""
    now = timezone.now()
    with transaction.atomic():
        job = _locked(job_id)
        if not job.is_active:
            return None
        lease = timedelta(seconds=settings.QUILT_FINE_TUNING_LEASE_SECONDS)
        if job.status == Status.RUNNING and job.heartbeat_at is not None and job.heartbeat_at > now - lease:
            return None  # a live trainer holds it
        limit = settings.QUILT_FINE_TUNING_MAX_ATTEMPTS
        if job.attempts >= limit:
            _fail_locked(job, code="training_interrupted", message=(
                f"The trainer stopped {job.attempts} times before the job could finish (the worker was killed or ran "
                "out of memory). Try a smaller batch_size, or contact support if it keeps happening."
            ))  # fmt: skip
            return None
        token = secrets.token_hex(16)
        resuming = job.attempts > 0
        job.attempts += 1
        job.status = Status.RUNNING
        job.run_token = token
        job.heartbeat_at = now
        job.started_at = job.started_at or now
        job.save(update_fields=["attempts", "status", "run_token", "heartbeat_at", "started_at"])
        job_event(job=job, message=(
            f"The trainer was interrupted; resuming (attempt {job.attempts} of {limit})" if resuming
            else "Fine-tuning job started"
        ))  # fmt: skip
    return job, token


class _Progress:
    """What the trainer reports, written to the job while the claim is still this run's."""

    def __init__(self, job: FineTuningJob, token: str):
        self.job, self.token = job, token

    def _renew(self, **fields) -> bool:
        alive = FineTuningJob.objects.filter(pk=self.job.pk, status=Status.RUNNING, run_token=self.token)
        return alive.update(heartbeat_at=timezone.now(), **fields) == 1

    def resumed(self, *, step: int) -> None:
        if self._renew(steps_done=step):
            job_event(job=self.job, message=f"Resumed from the checkpoint at step {step}")

    def step(self, metrics: trainer.Metrics) -> bool:
        if not self._renew(steps_done=metrics.step):
            return False
        data = {"step": metrics.step, "total_steps": metrics.total_steps, "train_loss": metrics.train_loss,
                "train_mean_token_accuracy": metrics.train_mean_token_accuracy}  # fmt: skip
        message = f"Step {metrics.step}/{metrics.total_steps}: training loss={metrics.train_loss:.4f}"
        if metrics.valid_loss is not None:
            data["valid_loss"] = metrics.valid_loss
            message += f", validation loss={metrics.valid_loss:.4f}"
        job_event(job=self.job, kind=JobEvent.Kind.METRICS, message=message, data=data)
        return True

    def checkpoint(self, *, step: int, path: Path, metrics: trainer.Metrics) -> None:
        values = {"step": step, "train_loss": metrics.train_loss,
                  "train_mean_token_accuracy": metrics.train_mean_token_accuracy, "valid_loss": metrics.valid_loss}
        JobCheckpoint.objects.update_or_create(job=self.job, step=step, defaults={"metrics": values})


def _device() -> str:
    return settings.QUILT_FINE_TUNING_DEVICE or ("cuda" if torch.cuda.is_available() else "cpu")


def _training_run(job: FineTuningJob) -> trainer.TrainingRun:
    base = job.base_model
    encode = {"method": job.method, "checkpoint_dir": base.checkpoint_dir, "max_context": base.max_context}
    train = examples_encode(uploaded=job.training_file, minimum=dataset.MIN_EXAMPLES, **encode)
    validation = examples_encode(uploaded=job.validation_file, minimum=1, **encode) if job.validation_file else []
    h = job.hyperparameters
    return trainer.TrainingRun(
        base_dir=Path(base.checkpoint_dir), method=job.method, train=train, validation=validation,
        hyperparameters=Hyperparameters(
            n_epochs=h["n_epochs"], batch_size=h["batch_size"], learning_rate=learning_rate(h),
            lora_rank=h["lora_rank"], lora_alpha=h["lora_alpha"], beta=h.get("beta", 0.1), seed=job.seed,
        ),
        work_dir=storage.work_dir(job_public_id=job.public_id),
        checkpoint_every=max(1, settings.QUILT_FINE_TUNING_CHECKPOINT_STEPS), device=_device(),
    )  # fmt: skip


def _version_create(job: FineTuningJob, token: str, adapter_dir: Path) -> AdapterVersion | None:
    """The trained adapter as the suffix's next version (a new adapter for a new suffix), still `uploaded`."""
    actor = Actor(key=job.created_by_key)
    paths = sorted(p for p in adapter_dir.iterdir() if p.is_file())
    with ExitStack() as stack, transaction.atomic():
        files = [File(stack.enter_context(open(p, "rb")), name=p.name) for p in paths]
        locked = _locked(job.pk)
        if locked.status != Status.RUNNING or locked.run_token != token:
            return None
        existing = adapter_get(tenant=locked.tenant, name=locked.suffix)
        if existing is not None:
            version = adapter_version_create(actor=actor, adapter=existing, files=files, enqueue=False)
        else:
            adapter = adapter_create(
                actor=actor, tenant=locked.tenant, name=locked.suffix, base_model=locked.base_model.name, files=files,
                description=f"Fine-tuned by {locked.public_id}", enqueue=False,
            )  # fmt: skip
            version = adapter.versions.get(number=1)
        locked.adapter_version = version
        locked.save(update_fields=["adapter_version"])
    return version


def _publish(job: FineTuningJob, token: str, *, trained_tokens: int, adapter_dir: Path | None) -> str:
    version = job.adapter_version
    if version is None:
        version = _version_create(job, token, adapter_dir)
        if version is None:
            return "stopped"
    version = adapter_version_validate(version_id=version.pk)
    with transaction.atomic():
        locked = _locked(job.pk)
        if locked.status != Status.RUNNING or locked.run_token != token:
            return locked.status
        if not version.is_ready:
            _fail_locked(locked, code="adapter_invalid",
                         message=f"The trained adapter failed validation: {version.failure_message}")  # fmt: skip
            return locked.status
        adapter = version.adapter
        adapter.refresh_from_db(fields=["current_version"])
        name = adapter.name if adapter.current_version_id == version.pk else f"{adapter.name}@{version.number}"
        locked.status = Status.SUCCEEDED
        locked.fine_tuned_model = name
        locked.trained_tokens = trained_tokens
        locked.run_token = ""
        locked.finished_at = timezone.now()
        locked.save(update_fields=["status", "fine_tuned_model", "trained_tokens", "run_token", "finished_at"])
        job_event(job=locked, message=f"New fine-tuned model created: {name}")
        job_event(job=locked, message="The job has successfully completed")
        public_id = locked.public_id
        transaction.on_commit(lambda: storage.work_dir_remove(job_public_id=public_id), robust=True)
    return locked.status


def _stopped(job: FineTuningJob, step: int) -> str:
    job.refresh_from_db(fields=["status"])
    if job.status == Status.CANCELLED:
        job_event(job=job, message=f"Training stopped at step {step}: the job was cancelled")
        storage.work_dir_remove(job_public_id=job.public_id)
    return job.status


def job_run(*, job_id: int) -> str:
    """Claims, trains and publishes the job; safe to run again at any point (it resumes or does nothing)."""
    claimed = _claim(job_id)
    if claimed is None:
        return FineTuningJob.objects.get(pk=job_id).status
    job, token = claimed
    if settings.QUILT_FINE_TUNING_THREADS:
        torch.set_num_threads(settings.QUILT_FINE_TUNING_THREADS)
    try:
        run = _training_run(job)
        if job.adapter_version_id is not None:  # trained and handed to the registry before an interruption
            return _publish(job, token, trained_tokens=trainer.trained_tokens(run, job.total_steps), adapter_dir=None)
        result = trainer.train(run, _Progress(job, token))
        if result.adapter_dir is None:
            return _stopped(job, result.steps)
        return _publish(job, token, trained_tokens=result.trained_tokens, adapter_dir=result.adapter_dir)
    except dataset.DatasetInvalid as invalid:
        _fail(job.pk, token, code="invalid_training_file", message=invalid.message)
    except RegistryRefusal as refusal:
        _fail(job.pk, token, code=refusal.code, message=refusal.message)
    except torch.OutOfMemoryError:
        _fail(job.pk, token, code="out_of_memory", message="Training ran out of memory; try a smaller batch_size.")
    except Exception:
        logger.exception("fine-tuning job %s failed", job.public_id)
        _fail(job.pk, token, code="training_error", message="Training failed on an internal error; try again.")
        raise
    return FineTuningJob.objects.get(pk=job_id).status
