"""benchmarks/speculative.py runs end to end (--quick, on the tiny checkpoint) and prints its table."""

import subprocess
import sys
from pathlib import Path

from tests.engine.conftest import build_checkpoint

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_prints_on_and_off(tmp_path):
    model = build_checkpoint(tmp_path / "tiny", "llama", seed=5)
    done = subprocess.run([sys.executable, "-m", "benchmarks.speculative", "--quick", "--model", str(model),
                           "--methods", "ngram", "draft", "--draft", str(model)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| random |")]
    assert [r.split("|")[2].strip() for r in rows] == ["off", "ngram", "draft"]
    assert all(r.split("|")[10].strip() == "yes" for r in rows)  # greedy: the same output on and off
