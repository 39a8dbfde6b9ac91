"""ASGI entry: `uvicorn quilt.asgi:application` (run from the repository root with platform/ on the path)."""

import os
import sys
from pathlib import Path

_platform = str(Path(__file__).resolve().parents[1])
if _platform not in sys.path:
    sys.path.insert(0, _platform)

from quilt.paths import ensure_on_path  # noqa: E402

ensure_on_path()
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "quilt.settings.dev")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from quilt.routing import build_application  # noqa: E402

application = build_application(django_asgi_app)
