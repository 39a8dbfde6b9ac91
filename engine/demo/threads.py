"""How many torch threads the demo build uses, re-decided as it runs.

The demo model is tiny (hidden 128): a second thread saves little, but an OpenMP thread that must share its core
with another process stalls every step at the barriers where the threads wait for each other (measured on a
2-core machine with two other busy processes: 2.5 s a step with 2 threads, 0.2 s with 1). So the build uses one
thread per core that other processes leave idle, measured from the machine's CPU time less this process's own
over the last couple of seconds, and re-decided every couple of seconds. The thread count does not change the
result: a build with 1 thread and one with 2 write identical weights.
"""

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

MAX_THREADS = 4
WINDOW_SECONDS = 2.0
SLACK = 0.25  # cores of other work tolerated beside each of our threads (a shell, a short-lived process)
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # /proc/stat cpu: user nice system irq softirq steal (not idle, iowait)


@dataclass(frozen=True)
class Sample:
    at: float  # monotonic seconds
    machine: float | None  # CPU seconds the whole machine spent busy, None where /proc/stat is not there
    own: float  # CPU seconds of this process


def threads_for(*, cpu_count: int, others: float, max_threads: int = MAX_THREADS) -> int:
    """Threads for the cores left idle by `others` cores of other processes' work, at least 1."""
    idle = cpu_count - others + SLACK
    return max(1, min(max_threads, cpu_count, math.floor(idle)))


def sample(stat: Path = Path("/proc/stat")) -> Sample:
    try:
        fields = stat.read_text().split("\n", 1)[0].split()[1:]
        machine = sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields)) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        machine = None
    return Sample(at=time.monotonic(), machine=machine, own=time.process_time())


def others_between(first: Sample, last: Sample, *, threads: int) -> float:
    """Cores other processes kept busy between two samples (from the load average where there is no
    /proc/stat: it counts our own threads, and lags by a minute)."""
    if first.machine is None or last.machine is None:
        return max(0.0, os.getloadavg()[0] - threads)
    seconds = max(last.at - first.at, 1e-6)
    return max(0.0, (last.machine - first.machine) - (last.own - first.own)) / seconds


class ThreadGovernor:
    """Call `tick()` often (every training step); it sets torch's thread count at most every WINDOW_SECONDS.
    Starts at 1 thread: the first window tells whether the cores are free."""

    def __init__(self, *, cpu_count: int | None = None, max_threads: int = MAX_THREADS) -> None:
        self.cpu_count = cpu_count or os.cpu_count() or 1
        self.max_threads = max_threads
        self.threads = 1
        self.others = 0.0  # cores other processes used over the last window
        self.history: list[int] = [1]  # every count used, in order (the build's log shows it)
        torch.set_num_threads(1)
        self._mark = sample()

    def tick(self) -> None:
        now = sample()
        if now.at - self._mark.at < WINDOW_SECONDS:
            return
        self.others = others_between(self._mark, now, threads=self.threads)
        self._mark = now
        threads = threads_for(cpu_count=self.cpu_count, others=self.others, max_threads=self.max_threads)
        if threads != self.threads:
            self.threads = threads
            self.history.append(threads)
            torch.set_num_threads(threads)
