"""Budget alerts at 80% and 100%, once per month each, by email and a signed webhook to a real local server."""

import hashlib
import hmac
import json
import threading
from datetime import UTC, date, datetime
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core import mail

from billing.alerts import WebhookFailed, budget_alerts_check
from billing.models import BudgetAlert
from metering.services import usage_ingest
from quilt.celery import app
from tests.metering.usage import gpu_engine, priced_tenant, usage_event

pytestmark = pytest.mark.django_db

SECRET = "whsec-test-0123456789"
OCTOBER = date(2026, 10, 1)


class WebhookReceiver(BaseHTTPRequestHandler):
    received: list
    status = 204

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((dict(self.headers), body))
        self.send_response(self.status)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    handler = type("Receiver", (WebhookReceiver,), {"received": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}/hooks/quilt"
    server.shutdown()
    server.server_close()


@pytest.fixture
def eager_tasks():
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = False


def _tenant(receiver_url, **plan_fields):
    gpu_engine()
    tenant = priced_tenant("acme", **plan_fields)
    tenant.billing_email = "billing@acme.test"
    tenant.webhook_url = receiver_url
    tenant.webhook_secret = SECRET
    tenant.save()
    return tenant


def _ingest(tenant, capture, count: int):
    with capture(execute=True):
        usage_ingest(
            events=[usage_event(tenant, finished_at=datetime(2026, 10, 9, tzinfo=UTC)) for _ in range(count)]
        )


def _verified(received) -> list[dict]:
    bodies = []
    for headers, body in received:
        expected = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
        assert hmac.compare_digest(headers["X-Quilt-Signature"], expected)
        bodies.append(json.loads(body))
    return bodies


def test_token_budget_alerts_fire_once_each_from_ingest(
    receiver, eager_tasks, django_capture_on_commit_callbacks
):
    handler, url = receiver
    tenant = _tenant(url, monthly_token_budget=10_000)  # 1,300 tokens per request
    _ingest(tenant, django_capture_on_commit_callbacks, 6)  # 7,800: 78%
    assert not handler.received and not mail.outbox
    _ingest(tenant, django_capture_on_commit_callbacks, 1)  # 9,100: 91%
    _ingest(tenant, django_capture_on_commit_callbacks, 1)  # 10,400: 104%
    _ingest(tenant, django_capture_on_commit_callbacks, 3)  # past 100% again: nothing new
    bodies = _verified(handler.received)
    assert [(body["kind"], body["threshold"], body["used"], body["limit"]) for body in bodies] == [
        ("tokens", 80, "9100", "10000"),
        ("tokens", 100, "10400", "10000"),
    ]
    assert {body["tenant"] for body in bodies} == {"acme"} and {body["month"] for body in bodies} == {
        "2026-10"
    }
    assert [message.to for message in mail.outbox] == [["billing@acme.test"]] * 2
    assert "80% of its monthly token budget for 2026-10" in mail.outbox[0].subject
    assert BudgetAlert.objects.filter(tenant=tenant, webhook_sent_at__isnull=False).count() == 2


def test_spend_limit_alerts(receiver, eager_tasks, django_capture_on_commit_callbacks):
    handler, url = receiver
    tenant = _tenant(url, monthly_spend_limit=Decimal("0.01"))  # 0.000875 per request
    _ingest(tenant, django_capture_on_commit_callbacks, 10)  # 0.00875: 87.5%
    _ingest(tenant, django_capture_on_commit_callbacks, 2)  # 0.0105: 105%
    assert [(body["kind"], body["threshold"]) for body in _verified(handler.received)] == [
        ("spend", 80),
        ("spend", 100),
    ]
    assert len(mail.outbox) == 2


def test_a_failed_webhook_is_retried_without_a_second_email(receiver):
    handler, url = receiver
    tenant = _tenant(url, monthly_token_budget=1_000)
    usage_ingest(events=[usage_event(tenant, finished_at=datetime(2026, 10, 9, tzinfo=UTC))])
    handler.status = 500
    with pytest.raises(WebhookFailed):
        budget_alerts_check(tenant=tenant, month=OCTOBER)
    assert len(mail.outbox) == 2 and len(handler.received) == 2  # 80% and 100% at once
    assert all("500" in alert.webhook_error for alert in BudgetAlert.objects.all())
    handler.status = 204
    budget_alerts_check(tenant=tenant, month=OCTOBER)
    budget_alerts_check(tenant=tenant, month=OCTOBER)
    assert len(mail.outbox) == 2 and len(handler.received) == 4
    assert not BudgetAlert.objects.filter(webhook_sent_at__isnull=True).exists()


def test_no_limit_no_alert(receiver, eager_tasks, django_capture_on_commit_callbacks):
    handler, url = receiver
    tenant = _tenant(url)
    _ingest(tenant, django_capture_on_commit_callbacks, 5)
    assert budget_alerts_check(tenant=tenant, month=OCTOBER) == []
    assert not handler.received and not mail.outbox and not BudgetAlert.objects.exists()


def test_the_100_percent_alert_fires_when_admission_refuses_short_of_the_limit(receiver):
    handler, url = receiver
    tenant = _tenant(url, monthly_token_budget=10_000)
    usage_ingest(events=[usage_event(tenant, finished_at=datetime(2026, 10, 9, tzinfo=UTC)) for _ in range(7)])
    budget_alerts_check(tenant=tenant, month=OCTOBER)  # 9,100 of 10,000: 80% only
    # Admission refused a request that needed more than the 900 tokens left: usage will never reach 100%.
    budget_alerts_check(tenant=tenant, month=OCTOBER, exhausted="tokens")
    budget_alerts_check(tenant=tenant, month=OCTOBER, exhausted="tokens")  # once
    assert [(body["threshold"], body["used"], body["limit"]) for body in _verified(handler.received)] == [
        (80, "9100", "10000"),
        (100, "9100", "10000"),
    ]
    assert len(mail.outbox) == 2


def test_a_budget_change_refreshes_the_months_alerts(receiver, eager_tasks, django_capture_on_commit_callbacks):
    handler, url = receiver
    tenant = _tenant(url, monthly_token_budget=10_000)
    usage_ingest(events=[usage_event(tenant, finished_at=datetime(2026, 10, 9, tzinfo=UTC)) for _ in range(7)])
    budget_alerts_check(tenant=tenant, month=OCTOBER)
    assert BudgetAlert.objects.get().threshold == 80
    plan = tenant.plan
    plan.monthly_token_budget = 20_000  # 9,100 is 45.5% now: the 80% alert is re-armed
    with django_capture_on_commit_callbacks(execute=True):
        plan.save()  # the billing receiver checks the plan's tenants (for this month)
    budget_alerts_check(tenant=tenant, month=OCTOBER)
    assert not BudgetAlert.objects.exists()
    plan.monthly_token_budget = 9_000  # 101%: both thresholds, with the new figures
    plan.save()
    budget_alerts_check(tenant=tenant, month=OCTOBER)
    alerts = BudgetAlert.objects.order_by("threshold")
    assert [(a.threshold, a.used, a.limit) for a in alerts] == [(80, 9100, 9000), (100, 9100, 9000)]
    assert [(b["threshold"], b["limit"]) for b in _verified(handler.received)][-2:] == [(80, "9000"), (100, "9000")]
