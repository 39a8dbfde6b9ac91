"""A real ASGI server (uvicorn, the production entry point) and a real Celery worker on the test database,
sharing a Redis channel layer, for the browser tests. Debian's Chromium drives the pages through Playwright."""

import os
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO, start_worker, test_database_url
from tests.console.live_asgi import DRAIN_PATH
from tests.ports import free_port

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-sync", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--disable-dev-shm-usage"]  # fmt: skip
CHANNELS_REDIS = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379") + "/13"
# Admission counters are keyed by tenant id: a prefix of this run's own keeps other runs' counters apart.
REDIS_KEY_PREFIX = f"quilt-console-{uuid.uuid4().hex[:10]}"


def shared_env(media_root: Path) -> dict:
    """What the server and the worker must agree on: database, broker and queue, channel layer, media."""
    from django.conf import settings

    return {
        "DATABASE_URL": test_database_url(),
        "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
        "CELERY_TASK_DEFAULT_QUEUE": settings.CELERY_TASK_DEFAULT_QUEUE,
        "REDIS_URL": CHANNELS_REDIS,
        "QUILT_REDIS_KEY_PREFIX": REDIS_KEY_PREFIX,
        "MEDIA_ROOT": str(media_root),
    }


# The server's connections name themselves (libpq reads PGAPPNAME), so a teardown can see what they are doing.
SERVER_APPLICATION_NAME = "quilt-console-live-server"
IN_TRANSACTION = ("active", "idle in transaction", "idle in transaction (aborted)")


@dataclass
class LiveServer:
    url: str
    process: subprocess.Popen

    def drain(self, *, timeout_s: float = 60.0) -> None:
        """Returns once the server has no request, socket or view in flight and none of its database connections
        is inside a statement or a transaction: from then on it holds no lock that a flush of the test database
        could wait on. Callers first close what could send more (the browser's pages)."""
        with urllib.request.urlopen(self.url + DRAIN_PATH, timeout=timeout_s + 5) as answer:
            assert answer.status == 200, answer.read()
        deadline = time.monotonic() + timeout_s
        while (busy := server_connections_in_transaction()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not busy, f"the live server still holds database work after its drain: {busy}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_server(media_root: Path) -> LiveServer:
    port = free_port()
    env = {
        **os.environ, **shared_env(media_root), "DJANGO_SETTINGS_MODULE": "tests.console.server_settings",
        "PYTHONPATH": f"{REPO}:{REPO / 'platform'}", "DJANGO_ALLOW_ASYNC_UNSAFE": "",
        "PGAPPNAME": SERVER_APPLICATION_NAME,
    }  # fmt: skip
    command = [sys.executable, "-m", "uvicorn", "tests.console.live_asgi:application", "--host", "127.0.0.1", "--port", str(port),
               "--app-dir", str(REPO / "platform"), "--log-level", "warning", "--ws", "websockets"]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"uvicorn exited with {process.returncode}")
        try:
            urllib.request.urlopen(url + "/login/", timeout=2)
            return LiveServer(url=url, process=process)
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("uvicorn did not answer within 60 s")


def server_connections_in_transaction() -> list[tuple]:
    """(pid, state, query) of the live server's connections to the test database that run a statement or sit in
    a transaction (an idle connection holds no lock)."""
    from django.db import connection

    if connection.vendor != "postgresql":
        return []
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, state, query FROM pg_stat_activity"
            " WHERE application_name = %s AND datname = current_database() AND state = ANY(%s)",
            [SERVER_APPLICATION_NAME, list(IN_TRANSACTION)],
        )
        return cursor.fetchall()


def start_live_worker(media_root: Path) -> subprocess.Popen:
    return start_worker(extra_env=shared_env(media_root))


def start_engine(model_dir: Path, media_root: Path, *, served_name: str, token: str) -> tuple[subprocess.Popen, str]:
    """`python -m engine` on CPU over the tiny base, reading adapters from the store and sending usage events to
    this run's queue; returns once /v1/health answers."""
    from django.conf import settings

    port = free_port()
    command = [
        sys.executable, "-m", "engine", "--model", str(model_dir), "--port", str(port), "--device", "cpu",
        "--adapter-store", str(media_root / "adapters"), "--served-model-name", served_name,
        "--usage-queue", settings.CELERY_TASK_DEFAULT_QUEUE, "--broker-url", settings.CELERY_BROKER_URL,
        "--usage-spool", str(media_root / f"spool-{port}.jsonl"), "--num-kv-blocks", "64", "--log-level", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO, env={**os.environ, "QUILT_ENGINE_TOKEN": token})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the engine exited with {process.returncode}")
        request = urllib.request.Request(url + "/v1/health", headers={"Authorization": f"Bearer {token}"})
        try:
            urllib.request.urlopen(request, timeout=2)
            return process, url
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the engine did not answer within 120 s")
