"""A benchmark's work folder (its checkpoints and adapters), removed when the benchmark ends: when it finishes, when
it fails, and when it is stopped by SIGINT (gpu_suite.sh's `timeout -s INT`) or SIGTERM. An 8B-shaped checkpoint
is 16 to 25 GB: on the GPU machine, whose /tmp stays between the device tool's calls, two left behind filled the
64 GiB disk and the next step failed with ENOSPC.

SIGINT is set to raise KeyboardInterrupt while the folder lives, even where the process started with SIGINT ignored
(a command sent to the background by a shell without job control), in which case Python would not install its
own handler and the signal would do nothing until `timeout -k` kills the process, leaving the folder. SIGTERM exits
through SystemExit, so that the same `finally` runs. A SIGKILL cannot be answered: the limits leave time to end."""

import shutil
import signal
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path


def _exit_on_sigterm(signum, frame):
    sys.exit(128 + signum)


JOIN_SECONDS = 15  # within gpu_suite.sh's `timeout -k 20` grace after its SIGINT


def _join_writers(*, deadline: float) -> None:
    """Waits (until `deadline`) for the process's other non-daemon threads, which may still write in the folder: a
    thread pool's worker that the interrupt left unknown to its pool (KeyboardInterrupt while the pool started it)
    goes on with the queued work after the pool's shutdown."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


@contextmanager
def work_folder(prefix: str, *, path: Path | None = None, keep: bool = False):
    """Yields a new folder in the temp dir named prefix..., or `path` (made if missing, never removed: the
    caller's), and removes a folder it made unless `keep`."""
    handlers = {}
    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        handlers = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
                    signal.SIGTERM: signal.signal(signal.SIGTERM, _exit_on_sigterm)}
    made, interrupted = None, True
    try:
        made = Path(tempfile.mkdtemp(prefix=prefix)) if path is None else None
        folder = made or path
        folder.mkdir(parents=True, exist_ok=True)
        yield folder
        interrupted = False
    finally:
        if made is not None and not keep:
            shutil.rmtree(made, ignore_errors=True)
            if interrupted:
                # Again after the writers, also when none is left by then: one may have ended just after the first
                # removal, having written in it (a mkdir(parents=True) remakes the folder).
                _join_writers(deadline=time.monotonic() + JOIN_SECONDS)
                shutil.rmtree(made, ignore_errors=True)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
