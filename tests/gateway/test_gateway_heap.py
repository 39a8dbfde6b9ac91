"""The gateway's process freezes what its start-up made: Django, the apps and their imports (about 280,000
objects) live as long as the process, so a full collection walks only what requests left behind. Unfrozen, each
full collection walks them all: 80-190 ms with the event loop stopped, on a 2-vCPU machine."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_gateways_start_up_objects_are_frozen():
    code = "import gc, gateway.asgi; print(gc.get_freeze_count(), len(gc.get_objects()))"
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'platform'}", "DJANGO_SETTINGS_MODULE": "quilt.settings.test"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    frozen, collected = map(int, done.stdout.split()[-2:])
    assert frozen > 100_000, "start-up's objects are not frozen"
    assert collected < frozen // 20, "a full collection still walks most of the heap"
