"""A job's event log: what it says to the tenant (messages) and its training curve (metrics)."""

from finetuning.models import FineTuningJob, JobEvent


def job_event(
    *, job: FineTuningJob, message: str, level: str = JobEvent.Level.INFO, kind: str = JobEvent.Kind.MESSAGE,
    data: dict | None = None,
) -> JobEvent:
    return JobEvent.objects.create(job=job, level=level, kind=kind, message=message, data=data)
