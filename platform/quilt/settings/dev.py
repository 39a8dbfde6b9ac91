"""Local development and the demo: the embedded defaults, debug on."""

from quilt.settings.base import *  # noqa: F403
from quilt.settings.base import env

DEBUG = env.bool("DEBUG", default=True)
