"""The running event loop and task without a system call.

CPython 3.11's `asyncio.get_running_loop()` calls getpid() on every use (to notice a fork), and so do
`asyncio.current_task()`, `create_task()`, `timeout()` and an Event's first wait; on a virtual machine a system call
costs microseconds, and the gateway's hot path asked a dozen times per request. The loop running in a thread is
remembered per thread and asked again only when that one is not running (another test's loop, say). The gateway
never forks while its loop runs, which is the case the getpid() check is there for."""

import asyncio
import threading
from asyncio.tasks import _current_tasks  # asyncio.current_task's own map (3.11, 3.12)


class _Here(threading.local):
    loop: asyncio.AbstractEventLoop | None = None  # the loop that last ran in this thread


_here = _Here()


def running_loop() -> asyncio.AbstractEventLoop:
    """`asyncio.get_running_loop()` (RuntimeError outside a running loop)."""
    loop = _here.loop
    if loop is None or not loop.is_running():
        loop = _here.loop = asyncio.get_running_loop()
    return loop


def current_task() -> asyncio.Task | None:
    """`asyncio.current_task()`: its look-up in the running loop's entry, without its frame or `running_loop`'s
    where the thread's loop is the one remembered."""
    loop = _here.loop
    if loop is None or not loop.is_running():
        loop = running_loop()
    return _current_tasks.get(loop)
