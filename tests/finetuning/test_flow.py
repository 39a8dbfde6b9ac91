"""The whole path with the `openai` package: upload the demo dataset, fine-tune the demo model in the training
worker, poll to `succeeded`, then chat with `fine_tuned_model` through the gateway and the engine, on held-out
sentences the training never saw. The base model echoes them; the fine-tuned one answers their last word."""

import json
from datetime import timedelta
from decimal import Decimal

import openai
import pytest

from engine.demo import corpus
from tests.finetuning.conftest import BASE_MODEL, TRAINING_PRICE, client, wait_for
from tests.gateway.v1_schema import check_answer
from training.demo_data import DATA_DIR, HYPERPARAMETERS, TRAIN_FILE, VALIDATION_FILE, last_word

pytestmark = [pytest.mark.django_db, pytest.mark.slow]
FINAL = ("succeeded", "failed", "cancelled")


def _answers(tuner, model: str, prompts: list[str]) -> list[str]:
    out = []
    for prompt in prompts:
        reply = tuner.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=12, temperature=0)  # fmt: skip
        out.append(reply.choices[0].message.content.strip())
    return out


def finished(tuner, job_id: str, *, timeout: float = 150):
    return wait_for(lambda: (job := tuner.fine_tuning.jobs.retrieve(job_id)).status in FINAL and job,
                    timeout=timeout, what=f"job {job_id} finishing", interval=0.5)  # fmt: skip


def test_a_tenant_fine_tunes_the_demo_model_and_chats_with_the_result(ft_stack):
    tuner = client(ft_stack, "main")
    train = tuner.files.create(file=(TRAIN_FILE, (DATA_DIR / TRAIN_FILE).read_bytes()), purpose="fine-tune")
    valid = tuner.files.create(file=(VALIDATION_FILE, (DATA_DIR / VALIDATION_FILE).read_bytes()), purpose="fine-tune")
    created = tuner.fine_tuning.jobs.create(
        model=BASE_MODEL, training_file=train.id, validation_file=valid.id, suffix="last-word", seed=7,
        method={"type": "supervised", "supervised": {"hyperparameters": HYPERPARAMETERS}},
    )  # fmt: skip
    assert (created.status, created.model, created.fine_tuned_model) == ("queued", BASE_MODEL, None)
    assert created.hyperparameters.n_epochs == 2 and created.hyperparameters.batch_size == 16

    job = finished(tuner, created.id)
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model == "last-word"
    assert job.trained_tokens > 0 and job.finished_at >= job.created_at
    assert job.id in [j.id for j in tuner.fine_tuning.jobs.list()]

    events = list(tuner.fine_tuning.jobs.list_events(job.id, limit=100))
    metrics = sorted((e.data for e in events if e.type == "metrics"), key=lambda d: d["step"])
    total = metrics[-1]["total_steps"]
    assert [m["step"] for m in metrics] == list(range(1, total + 1))
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"] / 4
    assert "valid_loss" in metrics[-1]
    assert any("New fine-tuned model created: last-word" in e.message for e in events)
    checkpoints = list(tuner.fine_tuning.jobs.checkpoints.list(job.id))
    assert checkpoints and checkpoints[0].step_number == total and checkpoints[0].metrics.train_loss is not None
    jobs = tuner.fine_tuning.jobs.with_raw_response
    for path, raw in (("/v1/fine_tuning/jobs", jobs.list()), ("/v1/fine_tuning/jobs/{job_id}", jobs.retrieve(job.id)),
                      ("/v1/fine_tuning/jobs/{job_id}/events", jobs.list_events(job.id)),
                      ("/v1/fine_tuning/jobs/{job_id}/checkpoints",
                       tuner.fine_tuning.jobs.checkpoints.with_raw_response.list(job.id))):  # fmt: skip
        check_answer("get", path, 200, raw.http_response.json())  # as the API docs describe them

    assert "last-word" in [m.id for m in tuner.models.list()]
    held_out = corpus.held_out_sentences(10)
    expected = [last_word(sentence) for sentence in held_out]
    tuned = _answers(tuner, job.fine_tuned_model, held_out)
    base = _answers(tuner, BASE_MODEL, held_out)
    tuned_right = sum(a == e for a, e in zip(tuned, expected, strict=True))
    base_right = sum(a == e for a, e in zip(base, expected, strict=True))
    assert tuned_right >= 8 and base_right <= 1, (tuned, base)

    # Another tenant sees neither the job nor the model.
    rival = client(ft_stack, "rival")
    with pytest.raises(openai.NotFoundError):
        rival.fine_tuning.jobs.retrieve(job.id)
    with pytest.raises(openai.NotFoundError):
        rival.chat.completions.create(model="last-word", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert job.id not in [j.id for j in rival.fine_tuning.jobs.list()]

    # The result is a version of the tenant's adapter like any upload, and training tokens are billed.
    from billing.invoices import invoice_issue, month_bounds
    from finetuning.models import FineTuningJob
    from registry.models import Adapter

    adapter = Adapter.objects.get(tenant_id=ft_stack.ids["main"], name="last-word", deleted_at__isnull=True)
    record = FineTuningJob.objects.get(public_id=job.id)
    assert adapter.current_version_id == record.adapter_version_id
    assert adapter.current_version.status == "ready" and adapter.current_version.rank == HYPERPARAMETERS["lora_rank"]
    month = record.finished_at.date().replace(day=1)
    invoice = invoice_issue(tenant=adapter.tenant, month=month, now=month_bounds(month)[1] + timedelta(hours=1))
    line = invoice.lines.get(model__startswith=f"fine-tuning {job.id}")
    assert line.input_tokens == job.trained_tokens
    assert line.amount == Decimal(job.trained_tokens) * TRAINING_PRICE / Decimal(1_000_000)  # exact: the total rounds


def test_a_dpo_job_trains_on_preference_pairs(ft_stack):
    tuner = client(ft_stack, "rival")
    pairs = []
    for line in (DATA_DIR / TRAIN_FILE).read_text().splitlines()[:24]:
        user, answer = json.loads(line)["messages"]
        pairs.append(json.dumps({"input": {"messages": [user]}, "preferred_output": [answer],
                                 "non_preferred_output": [{"role": "assistant", "content": user["content"]}]}))
    data = tuner.files.create(file=("pairs.jsonl", ("\n".join(pairs) + "\n").encode()), purpose="fine-tune")
    created = tuner.fine_tuning.jobs.create(model=BASE_MODEL, training_file=data.id, suffix="prefers", method={
        "type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2, "n_epochs": 1, "batch_size": 8}},
    })  # fmt: skip
    assert created.method.type == "dpo" and created.method.dpo.hyperparameters.beta == 0.2
    job = finished(tuner, created.id)
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model == "prefers" and job.trained_tokens > 0
    losses = [e.data["train_loss"] for e in tuner.fine_tuning.jobs.list_events(job.id) if e.type == "metrics"]
    assert len(losses) == 3
