"""The demo build's torch threads: one per core other processes leave idle, re-decided as it runs (a second
OpenMP thread sharing its core with another process made the build over ten times slower)."""

import os
import subprocess
import sys
import time

import pytest
import torch

from engine.demo.threads import WINDOW_SECONDS, ThreadGovernor, threads_for


@pytest.mark.parametrize("cpu_count,others,expected", [
    (2, 0.0, 2), (2, 0.2, 2), (2, 0.4, 1), (2, 1.0, 1), (2, 3.0, 1), (1, 0.0, 1),
    (4, 1.0, 3), (8, 0.0, 4), (16, 9.5, 4), (16, 14.0, 2),
])
def test_threads_for_the_idle_cores(cpu_count, others, expected):
    assert threads_for(cpu_count=cpu_count, others=others) == expected


@pytest.mark.timeout(60)
def test_one_thread_while_other_processes_keep_every_core_busy():
    previous = torch.get_num_threads()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)
        governor = ThreadGovernor(max_threads=4)
        x = torch.randn(256, 256)
        deadline = time.monotonic() + 3 * WINDOW_SECONDS
        while time.monotonic() < deadline:
            x = torch.tanh(x @ x)  # our own work is not counted as the others'
            governor.tick()
        assert governor.others > 0.5 * (os.cpu_count() or 1), governor.others
        assert governor.threads == 1 and torch.get_num_threads() == 1
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
        torch.set_num_threads(previous)
