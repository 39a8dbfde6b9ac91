"""Settings of the ASGI server the browser tests start: the test settings, with static files served from the
apps' folders (no collectstatic step) as in development, and the views in flight counted for the drain that a
test's teardown waits on (tests/console/live_asgi.py)."""

from quilt.settings.test import *  # noqa: F403
from quilt.settings.test import MIDDLEWARE

WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = True
MIDDLEWARE = ["tests.console.live_asgi.count_running_views", *MIDDLEWARE]
