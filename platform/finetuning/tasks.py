"""Celery tasks: thin and idempotent. Training runs in the `training` queue's own worker (QUILT_TRAINING_QUEUE),
so a long job never holds up the workers that ingest usage or validate uploads."""

from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from finetuning.models import FineTuningJob
from finetuning.selectors import jobs_stale


def job_enqueue(*, job_id: int) -> None:
    train_job.apply_async(args=[job_id], queue=settings.QUILT_TRAINING_QUEUE)


@shared_task(name="finetuning.train_job", acks_late=True, reject_on_worker_lost=True)
def train_job(job_id: int) -> str:
    from finetuning.runner import job_run  # torch, transformers and PEFT load in the training worker only

    try:
        return job_run(job_id=job_id)
    except FineTuningJob.DoesNotExist:
        return "gone"


@shared_task(name="finetuning.requeue_stale_jobs")
def requeue_stale_jobs() -> list[int]:
    """Queues again every job whose trainer stopped sending heartbeats (the next run resumes it), and every
    queued job no trainer has taken within the lease (its task may have been lost), at most once a lease."""
    lease = timedelta(seconds=settings.QUILT_FINE_TUNING_LEASE_SECONDS)
    stale = list(jobs_stale(lease=lease).values_list("id", flat=True))
    FineTuningJob.objects.filter(pk__in=stale, status=FineTuningJob.Status.QUEUED).update(heartbeat_at=timezone.now())
    for job_id in stale:
        job_enqueue(job_id=job_id)
    return stale
