"""A PostgreSQL restart under the gateway: during the outage /v1 answers 503 with Retry-After (OpenAI-shaped), and
afterwards every path works again without restarting the gateway, including admission's own thread.

The PostgreSQL restarted here is a private one (initdb into a temporary folder, on a free port): the shared
server serves other test runs. Its schema is copied from the test database; the real engine of the package's
stack serves the requests (its usage events name a tenant id the test database does not have, and are dropped)."""

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO
from tests.conftest import test_database_url as database_url
from tests.gateway.conftest import BASE_MODEL, free_port, launch_gateway, stop, wait_for_gateway, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

TENANT_ID = 900_001  # far above the test database's ids
PG_BIN = sorted(glob.glob("/usr/lib/postgresql/*/bin"))


def _as_postgres(*command: str, **kwargs) -> subprocess.CompletedProcess:
    prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    return subprocess.run([*prefix, *command], check=True, capture_output=True, text=True, **kwargs)


class PrivatePostgres:
    def __init__(self) -> None:
        self.bin = Path(PG_BIN[-1])
        self.root = Path(tempfile.mkdtemp(prefix="quilt-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
        _as_postgres(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres")

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/quilt_outage"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        _as_postgres(str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", options, "-w", "-l",
                     str(self.root / "log"), "start")  # fmt: skip

    def stop(self) -> None:
        _as_postgres(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", str(self.bin / "pg_ctl"), "-D", str(self.data), "-m",
                        "immediate", "stop"], capture_output=True)  # fmt: skip
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def private_postgres():
    if not PG_BIN or shutil.which("runuser") is None and os.geteuid() == 0:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) to start a private PostgreSQL")
    server = PrivatePostgres()
    try:
        server.start()
        source = database_url().replace("postgres://", "postgresql://")
        schema = subprocess.run([str(server.bin / "pg_dump"), "--schema-only", "--no-owner", source], check=True,
                                capture_output=True, text=True).stdout  # fmt: skip
        admin = f"postgresql://postgres@127.0.0.1:{server.port}/postgres"
        subprocess.run([str(server.bin / "psql"), admin, "-q", "-c", "CREATE DATABASE quilt_outage"], check=True,
                       capture_output=True)  # fmt: skip
        subprocess.run([str(server.bin / "psql"), server.url.replace("postgres://", "postgresql://"), "-q", "-v",
                        "ON_ERROR_STOP=1"], input=schema, check=True, capture_output=True, text=True)  # fmt: skip
        yield server
    finally:
        server.remove()


SEED = """
import sys
from decimal import Decimal
import django
django.setup()
from django.core.management import call_command
from apikeys.models import ApiKey
from gateway.services import engine_register
from tenancy.audit import Actor
from tenancy.models import Plan, Tenant
call_command("registerbasemodel", sys.argv[1], sys.argv[2], verbosity=0)
plan = Plan.objects.create(slug="outage", name="Outage", monthly_token_budget=10**9, requests_per_minute=10**6,
                           tokens_per_minute=10**9, max_concurrent_requests=100)
tenant = Tenant.objects.create(pk=int(sys.argv[4]), slug="outage", name="Outage", plan=plan)
_, key = ApiKey.objects.create_key(tenant=tenant, name="outage", scopes=["inference"])
assert engine_register(actor=Actor.system(), name="engine-a", url=sys.argv[3], gpu_price_per_hour=Decimal(1)).healthy
print(key)
"""


def _ask(gateway: str, key: str) -> httpx.Response:
    return httpx.post(f"{gateway}/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                      json={"model": BASE_MODEL, "prompt": "w1 w2", "max_tokens": 2})  # fmt: skip


def _forget_month(stack, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(stack.env["REDIS_URL"])
    for name in client.scan_iter(match=f"{prefix}:*month*"):
        client.delete(name)


def test_a_postgresql_restart_is_a_503_with_retry_after_then_everything_works_again(stack, private_postgres):
    prefix = f"quilt-outage-{uuid.uuid4().hex[:8]}"
    # A verified key is kept 1 s here (30 s by default with Redis): past that, authentication needs the database.
    env = {**stack.env, "DATABASE_URL": private_postgres.url, "QUILT_REDIS_KEY_PREFIX": prefix, "QUILT_KEY_CACHE_SECONDS": "1"}
    seeded = subprocess.run([sys.executable, "-c", SEED, BASE_MODEL, str(stack.model_dir), stack.engine_url,
                             str(TENANT_ID)], cwd=REPO, env=env, check=True, capture_output=True, text=True)  # fmt: skip
    key = seeded.stdout.strip().splitlines()[-1]
    media = Path(stack.env["MEDIA_ROOT"])
    gateways = {}
    for name, extra in (("redis", {}), ("database", {"REDIS_URL": ""})):  # both admission backends
        port = free_port()
        process = launch_gateway(env | extra, port, media / f"outage-{name}.log")
        gateways[name] = (process, f"http://127.0.0.1:{port}/v1")
    try:
        for process, _ in gateways.values():
            wait_for_gateway(process)
        for name, (_, url) in gateways.items():
            assert _ask(url, key).status_code == 200, name  # admission's thread has its connection now

        private_postgres.stop()
        time.sleep(1.1)  # the key cache lapses: authentication needs the database
        for name, (_, url) in gateways.items():
            refused = _ask(url, key)
            assert refused.status_code == 503, (name, refused.status_code, refused.text)
            assert int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["code"] == "service_unavailable"

        private_postgres.start()
        _forget_month(stack, prefix)  # admission must read metering's record again, on its own thread
        for name, (_, url) in gateways.items():
            answered = wait_until(lambda url=url: (r := _ask(url, key)).status_code != 503 and r, timeout=30,
                                  what=f"{name} gateway answering after the restart")  # fmt: skip
            assert answered.status_code == 200, (name, answered.text)
            for _ in range(3):
                assert _ask(url, key).status_code == 200, name
    finally:
        for process, _ in gateways.values():
            stop(process)
