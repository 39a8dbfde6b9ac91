"""The console's fine-tuning page: a tenant's jobs, the chosen job's loss chart and events, nobody else's."""

import pytest
from django.test import Client
from django.urls import reverse

from finetuning.events import job_event
from finetuning.models import FineTuningJob, JobEvent, TrainingFile
from registry.models import BaseModel
from tests.platform.factories import MembershipFactory, TenantFactory

pytestmark = pytest.mark.django_db


def _job(tenant, base, **fields) -> FineTuningJob:
    data = TrainingFile.objects.create(tenant=tenant, filename="a.jsonl", bytes=1, storage_key="k",
                                       method="supervised", examples=10)  # fmt: skip
    return FineTuningJob.objects.create(
        tenant=tenant, base_model=base, training_file=data, method="supervised", suffix="last-word", seed=1,
        hyperparameters={}, total_steps=4, **fields,
    )  # fmt: skip


def test_the_page_lists_jobs_and_charts_the_chosen_ones_loss():
    tenant, other = TenantFactory(slug="tuners"), TenantFactory(slug="others")
    base = BaseModel.objects.create(name="page-base", checkpoint_dir="/x", architecture="llama", config={},
                                    max_context=256)  # fmt: skip
    job = _job(tenant, base, status=FineTuningJob.Status.SUCCEEDED, steps_done=4, fine_tuned_model="last-word")
    for step, loss in ((1, 2.5), (2, 1.2), (3, 0.6), (4, 0.2)):
        data = {"step": step, "total_steps": 4, "train_loss": loss} | ({"valid_loss": 0.3} if step == 4 else {})
        job_event(job=job, kind=JobEvent.Kind.METRICS, message=f"Step {step}/4", data=data)
    job_event(job=job, message="The job has successfully completed")
    hidden = _job(other, base, status=FineTuningJob.Status.RUNNING)
    membership = MembershipFactory(tenant=tenant, role="viewer")
    client = Client()
    client.force_login(membership.user, backend="django.contrib.auth.backends.ModelBackend")

    page = client.get(reverse("console:fine-tuning", kwargs={"slug": "tuners"}))
    html = page.content.decode()
    assert page.status_code == 200
    assert f'data-job="{job.public_id}"' in html and hidden.public_id not in html
    assert 'data-steps="4" data-validations="1"' in html
    assert "The job has successfully completed" in html and "Step 1/4" not in html  # metrics are in the chart
    assert 'data-nav="fine-tuning"' in html
    missing = client.get(reverse("console:fine-tuning", kwargs={"slug": "tuners"}), {"job": hidden.public_id})
    assert missing.status_code == 404


def test_the_legend_names_validation_loss_only_where_the_chart_draws_it():
    tenant = TenantFactory(slug="tuners")
    base = BaseModel.objects.create(name="page-base", checkpoint_dir="/x", architecture="llama", config={},
                                    max_context=256)  # fmt: skip
    job = _job(tenant, base, status=FineTuningJob.Status.RUNNING, steps_done=1)
    job_event(job=job, kind=JobEvent.Kind.METRICS, message="Step 1/4", data={"step": 1, "total_steps": 4,
                                                                              "train_loss": 2.5})  # fmt: skip
    client = Client()
    client.force_login(MembershipFactory(tenant=tenant, role="viewer").user,
                       backend="django.contrib.auth.backends.ModelBackend")  # fmt: skip
    url = reverse("console:fine-tuning", kwargs={"slug": "tuners"})
    html = client.get(url).content.decode()
    assert 'data-validations="0"' in html and "Validation loss" not in html
    job_event(job=job, kind=JobEvent.Kind.METRICS, message="Step 2/4", data={"step": 2, "total_steps": 4,
                                                                              "train_loss": 1.2, "valid_loss": 1.4})  # fmt: skip
    html = client.get(url).content.decode()
    assert 'data-validations="1"' in html and 'data-testid="legend-validation"' in html
