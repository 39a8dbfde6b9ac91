"""Fine-tuning objects in OpenAI's wire format (what the `openai` package parses)."""

from datetime import datetime

from finetuning.models import FineTuningJob, JobCheckpoint, JobEvent, TrainingFile


def _unix(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def file_object(uploaded: TrainingFile) -> dict:
    return {
        "id": uploaded.public_id, "object": "file", "bytes": uploaded.bytes, "created_at": _unix(uploaded.created_at),
        "filename": uploaded.filename, "purpose": uploaded.purpose, "status": "processed", "status_details": None,
        "expires_at": None,
    }  # fmt: skip


def file_deleted(uploaded: TrainingFile) -> dict:
    return {"id": uploaded.public_id, "object": "file", "deleted": True}


def _hyperparameters(job: FineTuningJob) -> dict:
    h = job.hyperparameters
    return {
        "n_epochs": h["n_epochs"], "batch_size": h["batch_size"],
        "learning_rate_multiplier": h["learning_rate_multiplier"], "lora_rank": h["lora_rank"],
        "lora_alpha": h["lora_alpha"], **({"beta": h["beta"]} if "beta" in h else {}),
    }  # fmt: skip


def job_object(job: FineTuningJob) -> dict:
    hyperparameters = _hyperparameters(job)
    error = None
    if job.status == FineTuningJob.Status.FAILED:
        error = {"code": job.error_code, "message": job.error_message, "param": job.error_param or None}
    return {
        "id": job.public_id,
        "object": "fine_tuning.job",
        "created_at": _unix(job.created_at),
        "finished_at": _unix(job.finished_at),
        "model": job.base_model.name,
        "fine_tuned_model": job.fine_tuned_model or None,
        "organization_id": job.tenant.slug,
        "status": job.status,
        "training_file": job.training_file.public_id,
        "validation_file": job.validation_file.public_id if job.validation_file else None,
        "result_files": [],
        "trained_tokens": job.trained_tokens,
        "hyperparameters": {k: v for k, v in hyperparameters.items() if k != "beta"},
        "method": {"type": job.method, job.method: {"hyperparameters": hyperparameters}},
        "seed": job.seed,
        "suffix": job.suffix,
        "error": error,
        "estimated_finish": None,
        "integrations": [],
        "metadata": job.metadata,
        "user_provided_suffix": job.suffix,
        "steps_done": job.steps_done,
        "total_steps": job.total_steps,
    }


def event_object(event: JobEvent) -> dict:
    return {
        "id": event.public_id, "object": "fine_tuning.job.event", "created_at": _unix(event.created_at),
        "level": event.level, "message": event.message, "type": event.kind, "data": event.data,
    }  # fmt: skip


def checkpoint_object(checkpoint: JobCheckpoint, job: FineTuningJob) -> dict:
    metrics = {k: v for k, v in checkpoint.metrics.items() if v is not None}
    return {
        "id": checkpoint.public_id, "object": "fine_tuning.job.checkpoint", "created_at": _unix(checkpoint.created_at),
        "fine_tuned_model_checkpoint": f"{job.suffix}:ckpt-step-{checkpoint.step}", "fine_tuning_job_id": job.public_id,
        "step_number": checkpoint.step, "metrics": metrics,
    }  # fmt: skip


def page(data: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": data, "has_more": has_more}
