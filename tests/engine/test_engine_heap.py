"""The engine's process freezes what its start-up made before it serves (the model's modules, torch and the other
imports: about 340,000 objects with the demo model), so a full collection walks only what requests left behind.
Before, each full collection walked them all: about 150 ms with the GIL held, every stream and the engine's step
loop stopped, on a 2-vCPU machine."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# `python -m engine` up to the point where it would serve: the server's run replaced by a report of the heap
SERVE_REPORTS_HEAP = """
import gc, sys
from engine.server.membership import Draining
Draining.run = lambda self: print("heap", gc.get_freeze_count(), len(gc.get_objects()))
from engine.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_engines_start_up_objects_are_frozen_before_it_serves(checkpoints, tmp_path):
    command = [sys.executable, "-c", SERVE_REPORTS_HEAP, "--model", str(checkpoints["llama"]), "--port", "0",
               "--usage-spool", str(tmp_path / "usage.jsonl"), "--broker-url", ""]  # fmt: skip
    env = {**os.environ, "QUILT_ENGINE_TOKEN": "t", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    frozen, collected = map(int, done.stdout.split("heap")[-1].split())
    assert frozen > 100_000, "start-up's objects are not frozen"
    assert collected < frozen // 20, "a full collection still walks most of the heap"
