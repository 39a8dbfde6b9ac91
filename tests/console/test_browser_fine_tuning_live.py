"""A running fine-tune's loss curve grows on the open page without a reload (real Chromium, the ASGI server, the
Redis channel layer): each training step the trainer logs (finetuning.events.job_event, as the runner calls it)
is pushed to the tenant's page, which re-fetches its chart."""

import threading

import pytest

from finetuning.events import job_event
from finetuning.models import FineTuningJob, JobEvent
from registry.models import BaseModel
from tests.console.live import CHANNELS_REDIS
from tests.console.test_browser import PASSWORD, log_in
from tests.console.test_browser_charts import AXIS_SIZES_AND_OVERLAPS, CLIPPED_LABELS
from tests.finetuning.test_console_page import _job
from tests.platform.factories import MembershipFactory, TenantFactory, UserFactory

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _train_step(job_id: int, step: int, loss: float) -> None:
    """A training step as the trainer logs it, on a thread of its own as in the worker (Playwright's sync API keeps
    an event loop on the test's thread, where a push can't run)."""
    from django.db import connection

    try:
        FineTuningJob.objects.filter(pk=job_id).update(steps_done=step)
        job_event(job=FineTuningJob.objects.get(pk=job_id), kind=JobEvent.Kind.METRICS, message=f"Step {step}/4",
                  data={"step": step, "total_steps": 4, "train_loss": loss})  # fmt: skip
    finally:
        connection.close()


def _on_a_thread(job_id: int, step: int, loss: float) -> None:
    trainer = threading.Thread(target=_train_step, args=(job_id, step, loss))
    trainer.start()
    trainer.join()


def test_a_running_jobs_curve_grows_live(browser, live_server_asgi, settings):
    # This process pushes through the same Redis channel layer as the server the page's socket is on.
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                                           "CONFIG": {"hosts": [CHANNELS_REDIS]}}}  # fmt: skip
    tenant = TenantFactory(slug="tuners", name="Tuners")
    MembershipFactory(tenant=tenant, user=UserFactory(username="tess", password=PASSWORD), role="viewer")
    base = BaseModel.objects.create(name="live-base", checkpoint_dir="/x", architecture="llama", config={},
                                    max_context=256)  # fmt: skip
    job = _job(tenant, base, status=FineTuningJob.Status.RUNNING)
    _on_a_thread(job.pk, 1, 2.5)
    page = log_in(browser, live_server_asgi, "tess")
    page.goto(live_server_asgi.url + f"/t/tuners/fine-tuning/?job={job.public_id}")
    page.wait_for_selector("body[data-live-connected=yes]")
    page.evaluate("window.__sameDocument = true")
    assert page.get_attribute("#loss-chart svg", "data-steps") == "1"
    for step, loss in ((2, 1.4), (3, 0.7)):
        _on_a_thread(job.pk, step, loss)
        page.wait_for_selector(f"#loss-chart svg[data-steps='{step}']", timeout=10_000)
    assert page.evaluate("window.__sameDocument") is True
    assert page.evaluate("document.body.dataset.liveRefreshedBy") == "socket"
    # On a phone the curve's axis labels are drawn whole and at least 12 px high.
    page.set_viewport_size({"width": 390, "height": 844})
    page.reload()
    assert page.evaluate(CLIPPED_LABELS) == []
    assert all(measured["smallest"] >= 12 for measured in page.evaluate(AXIS_SIZES_AND_OVERLAPS))
    page.context.close()
