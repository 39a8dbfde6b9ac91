"""The test suite: PostgreSQL by default (CI), fast password hashing, tasks run by a real worker where tested."""

from uuid import uuid4

from quilt.settings.base import *  # noqa: F403
from quilt.settings.base import DATABASES, database, env

DATABASES["default"] = database(env("DATABASE_URL", default="postgres://postgres@127.0.0.1:5432/quilt"))
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
AXES_ENABLED = env.bool("AXES_ENABLED", default=False)
EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
STORAGES["staticfiles"] = {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}  # noqa: F405

# A real Redis broker; a queue of this test run's own so parallel runs never take each other's tasks.
CELERY_BROKER_URL = env("CELERY_BROKER_URL", default=env("TEST_REDIS_URL", default="redis://127.0.0.1:6379") + "/14")
CELERY_TASK_DEFAULT_QUEUE = env("CELERY_TASK_DEFAULT_QUEUE", default=f"quilt-test-{uuid4().hex[:12]}")
# The billing tests' webhook receiver listens on loopback; tests of the refusal clear this.
QUILT_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.1/32"]
