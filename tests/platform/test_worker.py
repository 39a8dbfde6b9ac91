"""A real Celery worker, against Redis, runs tasks the platform sends and writes to the test database."""

import time

from quilt.celery import app
from tenancy.models import AuditLog, Tenant


def test_a_worker_over_redis_runs_a_task_that_writes_to_the_database(celery_worker):
    assert app.conf.broker_url.startswith("redis://")
    app.send_task("tests.create_tenant", args=["from-the-worker"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not Tenant.objects.filter(slug="from-the-worker").exists():
        time.sleep(0.2)
    assert Tenant.objects.filter(slug="from-the-worker").exists()
    assert AuditLog.objects.filter(action="tenant.create", tenant__slug="from-the-worker").count() == 1
