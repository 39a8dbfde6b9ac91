"""Real gateway processes (uvicorn, gateway.asgi) on this test run's database and their own Redis prefix."""

import contextlib
import os
import uuid

import httpx

from tests.conftest import REPO, test_database_url
from tests.gateway.conftest import free_port, launch_gateway, stop, wait_until

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379") + "/12"


@contextlib.contextmanager
def gateways(tmp_path, count: int, **extra_env: str):
    """Yields (base URLs, env) of `count` gateway processes; stops them after."""
    prefix = f"quilt-sec-{uuid.uuid4().hex[:10]}"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "quilt.settings.test",
        "DATABASE_URL": test_database_url(),
        "REDIS_URL": REDIS_URL,
        "QUILT_REDIS_KEY_PREFIX": prefix,
        "MEDIA_ROOT": str(tmp_path),
        "PYTHONPATH": f"{REPO}:{REPO / 'platform'}",
        "LOG_LEVEL": "WARNING",
        **extra_env,
    }
    processes, urls = [], []
    try:
        for number in range(count):
            port = free_port()
            processes.append(launch_gateway(env, port, tmp_path / f"gateway-{number}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        for process in processes:
            wait_until(lambda p=process: _answers(p.models_url), timeout=180, what="gateway answering", process=process)
        yield urls, env
    finally:
        for process in processes:
            stop(process)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code in (301, 401)
    except httpx.HTTPError:
        return False
