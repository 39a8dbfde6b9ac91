"""Settings of the ASGI server the browser tests start: the test settings, with static files served from the
apps' folders (no collectstatic step) as in development."""

from quilt.settings.test import *  # noqa: F403

WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = True
