"""Puts the project's source roots on sys.path (used by the ASGI entry and the Celery app)."""

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PLATFORM_ROOT = REPO_ROOT / "platform"


def ensure_on_path() -> None:
    for root in (PLATFORM_ROOT, REPO_ROOT):
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
