"""What /proc says of a process and the machine, for the benchmarks that read a process's CPU per request
(gateway_overhead.py): its CPU time, its system calls and wake-ups, the machine's ticks and load."""

import os
from pathlib import Path


def cpu_seconds(pid: int, tid: int | None = None) -> tuple[float, float]:
    """User and system CPU time of a process (all its threads) so far, from /proc; of one thread with `tid`."""
    stat = Path(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")
    fields = stat.read_text().rpartition(")")[2].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def io_counts(pid: int) -> tuple[int, int, int]:
    """The process's read and write system calls so far (all threads) and its main thread's voluntary context
    switches (each a wait that blocked: a wake-up), from /proc: counts the machine's speed does not change."""
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    status = Path(f"/proc/{pid}/task/{pid}/status").read_text()
    switches = int(status.partition("voluntary_ctxt_switches:")[2].split()[0])
    return int(io["syscr"]), int(io["syscw"]), switches


def machine_ticks() -> tuple[int, int]:
    """All CPUs' time so far and the part stolen by the hypervisor (other guests on the same host), in ticks."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields[:8]), fields[7]


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def main_thread_seconds(pid: int) -> float:
    """The CPU time of the process's main thread (its event loop: uvicorn and the application), user + system."""
    return sum(cpu_seconds(pid, pid))
