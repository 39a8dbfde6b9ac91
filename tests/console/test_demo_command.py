"""The demo's first run: one demo key across restarts (its secret kept in an owner-only file), and the demo
model's build reporting progress with a time estimate."""

import socket
import stat

import pytest

from apikeys.models import ApiKey
from apikeys.selectors import api_key_authenticate
from apikeys.services import api_key_revoke
from console.management.commands.seeddemo import demo_key_file, seed_demo
from engine.demo import builder
from tenancy.audit import Actor

pytestmark = pytest.mark.django_db


@pytest.fixture
def var_dir(settings, tmp_path):
    settings.VAR_DIR = tmp_path
    return tmp_path


def test_a_restart_reuses_the_demo_key_and_a_revoked_one_is_replaced(var_dir):
    from tenancy.models import Plan

    Plan.objects.get_or_create(slug="starter", defaults={"name": "Starter"})
    first = seed_demo(log=lambda line: None)
    second = seed_demo(log=lambda line: None)
    assert second.api_key == first.api_key and second.key_reused and not first.key_reused
    assert ApiKey.objects.filter(tenant=first.tenant, name="demo").count() == 1
    assert stat.S_IMODE(demo_key_file().stat().st_mode) == 0o600
    api_key_revoke(actor=Actor.system(), key=api_key_authenticate(presented=first.api_key))
    third = seed_demo(log=lambda line: None)
    assert third.api_key != first.api_key and not third.key_reused
    assert api_key_authenticate(presented=third.api_key).name == "demo"


def test_the_build_reports_progress_with_an_estimate(monkeypatch):
    clock = iter(float(second) for second in range(0, 1000, 3))
    monkeypatch.setattr(builder.time, "monotonic", lambda: next(clock))
    lines = []
    progress = builder.Progress(total_steps=10, log=lines.append)
    for _ in range(10):
        progress.step()
    assert lines[0] == "building the demo model: 20% (2/10 steps), 6 s so far, about 24 s left"
    assert lines[-1].startswith("building the demo model: 100% (10/10 steps)") and lines[-1].endswith("about 0 s left")


@pytest.mark.parametrize("busy", ["port", "engine_port"])
def test_a_port_already_in_use_stops_the_demo_at_once_and_says_which(var_dir, busy):
    """A second `make demo` (or any server on the port) fails before it builds, starts an engine or points the
    running demo's engine registration anywhere, with an error naming the port, not a bind error lost among the
    workers' banners."""
    from django.core.management import CommandError, call_command

    from gateway.models import Engine

    with socket.socket() as taken, socket.socket() as spare:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        spare.bind(("127.0.0.1", 0))
        ports = {"port": spare.getsockname()[1], "engine_port": spare.getsockname()[1]}
        ports[busy] = taken.getsockname()[1]
        spare.close()
        flag = {"port": "PORT", "engine_port": "ENGINE_PORT"}[busy]
        with pytest.raises(CommandError, match=rf"port {ports[busy]} .* in use.*make demo {flag}="):
            call_command("demo", **ports)
    assert not Engine.objects.exists() and not (var_dir / "demo-model").exists()


def test_the_demo_creates_the_brokers_tables_before_its_processes_race_to(tmp_path):
    """The engine, two workers and beat start at once on kombu's SQLite transport; were the tables left to each
    one's first use, all but one would log 'table kombu_message already exists'."""
    import sqlite3

    from console.management.commands.demo import broker_tables_create

    path = tmp_path / "broker.sqlite3"
    broker_tables_create(f"sqla+sqlite:///{path}")
    tables = {name for (name,) in sqlite3.connect(path).execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"kombu_message", "kombu_queue"} <= tables
    broker_tables_create(f"sqla+sqlite:///{path}")  # a restart: nothing to do, no error
    broker_tables_create("redis://127.0.0.1:6379/0")  # another broker creates nothing
