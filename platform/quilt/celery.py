"""The Celery app. Broker from CELERY_BROKER_URL (settings); tasks discovered in each app's tasks.py."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "quilt.settings.dev")

app = Celery("quilt")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
