"""Fixtures shared across the suite: a real Celery worker process against Redis, on the test database."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import freezegun
import pytest

from tests.ports import free_port

# freeze_time reads every attribute of every loaded module to patch its clocks; on transformers' lazy module that
# imports every model it knows (RAG pulls in datasets and pandas), which costs seconds and can crash the
# interpreter in the garbage collector. None of these libraries read the clock a test freezes.
freezegun.configure(extend_ignore_list=["transformers", "torch", "peft", "accelerate", "triton", "datasets",
                                        "pandas", "pyarrow", "guidellm"])

REPO = Path(__file__).resolve().parents[1]

# The fixtures that start a stack of processes (engines, gateways, a Celery worker) once for all the tests of their
# package (see pytest_collection_modifyitems).
STACK_FIXTURES = ("stack", "demo_stack", "vision_stack", "ft_stack")
FIGURES: list[str] = []  # what tests measured (a report's user property "figure"), shown in the run's summary


def pytest_collection_modifyitems(config, items):
    """In an xdist worker (.ci/test: `-n 2 --dist loadfile --no-loadscope-reorder`, which hands out whole modules
    in the order collected) the modules run in this order: those on a stack fixture first, each stack's together,
    so that a worker starts a stack once and keeps it while it takes that stack's modules; then the modules that
    start processes or run models on Triton's interpreter; then the rest; the larger first within each, so that
    the run does not end with one worker on a long module and the other idle."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)

    def rank(module: str) -> tuple:
        stacks = sorted({name for item in modules[module] for name in item.fixturenames if name in STACK_FIXTURES})
        slow = any("slow" in item.keywords or "triton_launchers" in item.fixturenames for item in modules[module])  # fmt: skip
        if stacks:
            return 0, STACK_FIXTURES.index(stacks[0]), -len(modules[module])
        return (1 if slow else 2), 0, -len(modules[module])

    items[:] = [item for module in sorted(modules, key=rank) for item in modules[module]]


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        FIGURES.extend(value for name, value in report.user_properties if name == "figure")


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section("figures")
        for line in FIGURES:
            terminalreporter.write_line(line)


def test_database_url() -> str:
    from django.db import connection

    params = connection.settings_dict
    host, port, user = params.get("HOST") or "127.0.0.1", params.get("PORT") or "5432", params.get("USER") or "postgres"
    if params["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{params['NAME']}"
    return f"postgres://{user}@{host}:{port}/{params['NAME']}"


def start_worker(*, include: tuple[str, ...] = (), extra_env: dict | None = None) -> subprocess.Popen:
    """Starts `celery worker` on this run's queue and test database; returns once it says it is ready."""
    from django.conf import settings

    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "quilt.settings.test",
        "DATABASE_URL": test_database_url(),
        "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
        "CELERY_TASK_DEFAULT_QUEUE": settings.CELERY_TASK_DEFAULT_QUEUE,
        "MEDIA_ROOT": str(settings.MEDIA_ROOT),
        "PYTHONPATH": f"{REPO}:{REPO / 'platform'}",
        **(extra_env or {}),
    }
    command = [
        sys.executable, "-m", "celery", "--workdir", str(REPO / "platform"), "-A", "quilt", "worker",
        "--loglevel", "INFO", "--pool", "solo", "--without-gossip", "--without-mingle", "--without-heartbeat",
        "-Q", settings.CELERY_TASK_DEFAULT_QUEUE,
    ]  # fmt: skip
    for module in include:
        command += ["--include", module]
    worker = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 90
    seen = []
    while time.monotonic() < deadline:
        line = worker.stdout.readline()
        if not line and worker.poll() is not None:
            break
        seen.append(line)
        if " ready." in line:
            worker.seen_output = seen
            return worker
    worker.kill()
    raise RuntimeError("the Celery worker did not start:\n" + "".join(seen[-40:]))


def stop_worker(worker: subprocess.Popen) -> None:
    # Cold shutdown: the tests wait for their tasks' effects before stopping the worker.
    worker.send_signal(signal.SIGQUIT)
    try:
        worker.wait(timeout=10)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


@pytest.fixture
def celery_worker(transactional_db):
    """A real worker process consuming this run's queue, sharing the (committed) test database."""
    worker = start_worker(include=("tests.platform.worker_tasks",))
    yield worker
    stop_worker(worker)


class RedisProcess:
    """A private redis-server we can stop and restart, to play an unreachable broker."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


@pytest.fixture
def private_redis():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisProcess(free_port())
    server.start()
    yield server
    server.stop()
