"""The test suite: PostgreSQL by default (CI), fast password hashing, tasks run by a real worker where tested."""

from quilt.settings.base import *  # noqa: F403
from quilt.settings.base import DATABASES, env

DATABASES["default"] = env.db("DATABASE_URL", default="postgres://postgres@127.0.0.1:5432/quilt")
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
AXES_ENABLED = env.bool("AXES_ENABLED", default=False)
EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
STORAGES["staticfiles"] = {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}  # noqa: F405
