"""Jobs that don't run to the end on their own: cancelled by the tenant (the trainer stops within seconds), and
a trainer killed with SIGKILL mid-job (the next run resumes from the last checkpoint, not from step 0)."""

import time

import openai
import pytest

from tests.finetuning.conftest import BASE_MODEL, CHECKPOINT_STEPS, LEASE_SECONDS, client, wait_for
from tests.finetuning.test_flow import finished
from training.demo_data import DATA_DIR, HYPERPARAMETERS, TRAIN_FILE

pytestmark = [pytest.mark.django_db, pytest.mark.slow]


def _start(tuner, *, n_epochs: int, suffix: str):
    train = tuner.files.create(file=(TRAIN_FILE, (DATA_DIR / TRAIN_FILE).read_bytes()), purpose="fine-tune")
    hyperparameters = {**HYPERPARAMETERS, "n_epochs": n_epochs}
    return tuner.fine_tuning.jobs.create(model=BASE_MODEL, training_file=train.id, suffix=suffix, seed=3,
                                         hyperparameters=hyperparameters), train  # fmt: skip


def _metrics(tuner, job_id: str) -> list[dict]:
    return [e.data for e in tuner.fine_tuning.jobs.list_events(job_id, limit=100) if e.type == "metrics"]


def _messages(tuner, job_id: str) -> list[str]:
    return [e.message for e in tuner.fine_tuning.jobs.list_events(job_id, limit=100)]


def test_a_cancelled_job_stops_training_within_seconds(ft_stack):
    tuner = client(ft_stack, "cancel")
    job, train = _start(tuner, n_epochs=40, suffix="never")  # 520 steps: minutes of work
    wait_for(lambda: _metrics(tuner, job.id), timeout=90, what="the first training step")

    # The plan runs one job at a time.
    with pytest.raises(openai.RateLimitError) as refused:
        tuner.fine_tuning.jobs.create(model=BASE_MODEL, training_file=train.id)
    assert refused.value.body["code"] == "fine_tuning_job_limit_reached"

    cancelled_at = time.monotonic()
    cancelled = tuner.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled" and cancelled.fine_tuned_model is None
    wait_for(lambda: any("Training stopped at step" in m for m in _messages(tuner, job.id)), timeout=10,
             what="the trainer stopping")  # fmt: skip
    stopped_after = time.monotonic() - cancelled_at
    steps = len(_metrics(tuner, job.id))
    time.sleep(1.5)
    assert len(_metrics(tuner, job.id)) == steps < 520
    assert tuner.fine_tuning.jobs.retrieve(job.id).status == "cancelled"
    assert stopped_after < 10
    with pytest.raises(openai.BadRequestError):
        tuner.fine_tuning.jobs.cancel(job.id)


def test_a_killed_trainer_resumes_from_its_last_checkpoint(ft_stack):
    from finetuning.tasks import requeue_stale_jobs

    tuner = client(ft_stack, "kill")
    job, _ = _start(tuner, n_epochs=8, suffix="resumed")  # 104 steps, a checkpoint every 5
    wait_for(lambda: len(list(tuner.fine_tuning.jobs.checkpoints.list(job.id))) >= 1, timeout=90,
             what="a first checkpoint", interval=0.05)  # fmt: skip
    ft_stack.processes["trainer"].kill()  # SIGKILL: no cleanup, the task is never acknowledged
    ft_stack.processes["trainer"].wait()
    killed_at = max(m["step"] for m in _metrics(tuner, job.id))
    assert killed_at < 104
    saved = max(c.step_number for c in tuner.fine_tuning.jobs.checkpoints.list(job.id))
    assert tuner.fine_tuning.jobs.retrieve(job.id).status == "running"

    ft_stack.start_trainer()
    time.sleep(LEASE_SECONDS + 0.5)  # its heartbeat is now stale
    assert requeue_stale_jobs() == [_job_pk(job.id)]

    done = finished(tuner, job.id)
    assert done.status == "succeeded", done.error
    messages = _messages(tuner, job.id)
    assert "The trainer was interrupted; resuming (attempt 2 of 3)" in messages
    resumed = [m for m in messages if m.startswith("Resumed from the checkpoint at step")]
    assert len(resumed) == 1
    resumed_at = int(resumed[0].rsplit(" ", 1)[1])
    assert resumed_at >= saved >= CHECKPOINT_STEPS and resumed_at % CHECKPOINT_STEPS == 0
    steps = sorted(m["step"] for m in _metrics(tuner, job.id))
    assert steps[-1] == 104
    assert steps.count(resumed_at + 1) <= 2 and steps.count(1) == 1  # not trained again from step 0
    reply = tuner.chat.completions.create(model=done.fine_tuned_model, temperature=0, max_tokens=8,
                                          messages=[{"role": "user", "content": "the pilot finds the moon again"}])
    assert reply.choices[0].message.content.strip() == "again"


def _job_pk(public_id: str) -> int:
    from finetuning.models import FineTuningJob

    return FineTuningJob.objects.get(public_id=public_id).pk
