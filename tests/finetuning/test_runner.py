"""Claiming a job in the training worker: a live trainer's job is left alone, and a job whose trainers keep
dying fails with a reason the tenant can read instead of running forever."""

from datetime import timedelta

import pytest
from django.utils import timezone

from finetuning import runner
from finetuning.models import FineTuningJob, JobEvent, TrainingFile
from registry.models import BaseModel
from tests.platform.factories import TenantFactory

pytestmark = pytest.mark.django_db


def _job(*, attempts: int, heartbeat_age: timedelta) -> FineTuningJob:
    tenant = TenantFactory()
    base = BaseModel.objects.create(name="runner-base", checkpoint_dir="/nonexistent", architecture="llama",
                                    config={}, max_context=256)  # fmt: skip
    data = TrainingFile.objects.create(tenant=tenant, filename="a.jsonl", bytes=1, storage_key="nowhere",
                                       method="supervised", examples=10)  # fmt: skip
    return FineTuningJob.objects.create(
        tenant=tenant, base_model=base, training_file=data, method="supervised", suffix="s", seed=1,
        hyperparameters={"n_epochs": 1, "batch_size": 1, "learning_rate_multiplier": 1, "lora_rank": 4,
                         "lora_alpha": 8},
        status=FineTuningJob.Status.RUNNING, attempts=attempts, run_token="theirs",
        heartbeat_at=timezone.now() - heartbeat_age,
    )  # fmt: skip


def test_a_job_whose_trainer_keeps_dying_fails_saying_why(settings):
    settings.QUILT_FINE_TUNING_MAX_ATTEMPTS = 3
    job = _job(attempts=3, heartbeat_age=timedelta(hours=1))
    assert runner.job_run(job_id=job.pk) == "failed"
    job.refresh_from_db()
    assert job.error_code == "training_interrupted" and job.run_token == "" and job.finished_at is not None
    assert "The trainer stopped 3 times before the job could finish" in job.error_message
    assert job.events.filter(level=JobEvent.Level.ERROR, message__startswith="Job failed: The trainer stopped").exists()


def test_a_job_with_a_live_trainer_is_left_to_it(settings):
    settings.QUILT_FINE_TUNING_LEASE_SECONDS = 600
    job = _job(attempts=1, heartbeat_age=timedelta(seconds=5))
    assert runner.job_run(job_id=job.pk) == "running"
    job.refresh_from_db()
    assert (job.attempts, job.run_token) == (1, "theirs")
