"""Reads over fine-tuning files, jobs and what jobs report. A tenant only ever sees its own."""

from datetime import timedelta

from django.db.models import QuerySet
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Coalesce
from django.utils import timezone

from finetuning.models import FineTuningJob, JobCheckpoint, JobEvent, TrainingFile
from tenancy.models import Tenant


def files_of(*, tenant: Tenant) -> QuerySet[TrainingFile]:
    return TrainingFile.objects.filter(tenant=tenant, deleted_at__isnull=True)


def files_ever_of(*, tenant: Tenant) -> QuerySet[TrainingFile]:
    """The tenant's files, deleted ones too (a listing's cursor may name one deleted since)."""
    return TrainingFile.objects.filter(tenant=tenant)


def file_get(*, tenant: Tenant, public_id: str) -> TrainingFile | None:
    return files_of(tenant=tenant).filter(public_id=public_id).first()


def jobs_of(*, tenant: Tenant, metadata: dict[str, str] | None = None) -> QuerySet[FineTuningJob]:
    """The tenant's jobs; with `metadata`, only those whose metadata has each of its keys with that value."""
    jobs = FineTuningJob.objects.filter(tenant=tenant).select_related(
        "base_model", "training_file", "validation_file", "tenant"
    )
    for number, (key, value) in enumerate((metadata or {}).items()):
        jobs = jobs.alias(**{f"_metadata_{number}": KeyTextTransform(key, "metadata")}).filter(
            **{f"_metadata_{number}": value}
        )
    return jobs


def job_get(*, tenant: Tenant, public_id: str) -> FineTuningJob | None:
    return jobs_of(tenant=tenant).filter(public_id=public_id).first()


def jobs_active() -> QuerySet[FineTuningJob]:
    return FineTuningJob.objects.filter(status__in=FineTuningJob.ACTIVE)


def jobs_stale(*, lease: timedelta) -> QuerySet[FineTuningJob]:
    """Jobs queued or running with no sign of life within `lease`: their trainer died or never got the task."""
    cutoff = timezone.now() - lease
    return (
        jobs_active()
        .annotate(last_sign=Coalesce("heartbeat_at", "created_at"))
        .filter(last_sign__lt=cutoff)
        .order_by("id")
    )


def events_of(*, job: FineTuningJob) -> QuerySet[JobEvent]:
    return JobEvent.objects.filter(job=job).order_by("-id")


def checkpoints_of(*, job: FineTuningJob) -> QuerySet[JobCheckpoint]:
    return JobCheckpoint.objects.filter(job=job).order_by("-id")


def loss_curve(*, job: FineTuningJob) -> list[dict]:
    """The job's metrics, oldest first: step, train_loss and (where measured) valid_loss."""
    rows = JobEvent.objects.filter(job=job, kind=JobEvent.Kind.METRICS).order_by("id").values_list("data", flat=True)
    return [row for row in rows if isinstance(row, dict) and "step" in row]


def page(queryset: QuerySet, *, after: int | None, limit: int, ascending: bool = False) -> tuple[list, bool]:
    """One page of a listing (newest first unless `ascending`), the cursor `after` being the row id of the last
    row already seen."""
    if after is not None:
        queryset = queryset.filter(id__gt=after) if ascending else queryset.filter(id__lt=after)
    rows = list(queryset.order_by("id" if ascending else "-id")[: limit + 1])
    return rows[:limit], len(rows) > limit
