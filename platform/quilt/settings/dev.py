"""Local development and the demo: the embedded defaults, debug on."""

from quilt.settings.base import *  # noqa: F403
from quilt.settings.base import env

DEBUG = env.bool("DEBUG", default=True)
QUILT_WEBHOOK_ALLOWED_NETWORKS = env.list("QUILT_WEBHOOK_ALLOWED_NETWORKS", default=["127.0.0.1/32", "::1/128"])
