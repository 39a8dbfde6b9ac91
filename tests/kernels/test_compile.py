"""Every Triton kernel compiles for sm_90 (H100/H200), in a fresh process outside interpreter mode."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.compile_check import CASES, DOT_CASES

SCRIPT = Path(__file__).with_name("compile_check.py")
NAMES = [f"{c}-bf16" for c in CASES] + [f"{c}-fp32" for c in DOT_CASES]


@pytest.fixture(scope="module")
def compiled() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "90"], env=env, capture_output=True, text=True,
                          timeout=500)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", NAMES)
def test_kernel_compiles(compiled, name):
    assert compiled[name] == "ok", compiled[name]
