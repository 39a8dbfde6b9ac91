"""Production settings refuse to start half-configured, pass `check --deploy`, and the compose file parses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PRODUCTION_ENV = {
    "DJANGO_SETTINGS_MODULE": "quilt.settings.production",
    "SECRET_KEY": "x7#kP2!vQ9zR4mL8wN3bT6yH1jF5dS0aG7cV2xZ9qW4eR8tY3uI6oP1",
    "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/postgres",
    "ALLOWED_HOSTS": "quilt.example.com",
    "QUILT_ENGINE_TOKEN": "e" * 40,
    "EMAIL_BACKEND": "django.core.mail.backends.smtp.EmailBackend",
}


def _manage(*args: str, env: dict) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ["PATH"], "HOME": "/tmp"}
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=REPO, env=base | env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("missing", ["SECRET_KEY", "DATABASE_URL", "ALLOWED_HOSTS", "QUILT_ENGINE_TOKEN", "EMAIL_BACKEND"])
def test_production_refuses_to_start_without(missing):
    env = {key: value for key, value in PRODUCTION_ENV.items() if key != missing}
    result = _manage("check", env=env)
    assert result.returncode != 0
    assert missing in result.stderr


@pytest.mark.parametrize(
    ("name", "value"),
    [("QUILT_ENGINE_TOKEN", "dev-engine-token"), ("QUILT_ENGINE_TOKEN", "short"),
     ("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend"),
     ("EMAIL_BACKEND", "django.core.mail.backends.locmem.EmailBackend")],
)  # fmt: skip
def test_production_refuses_a_known_engine_token_or_an_email_backend_that_delivers_nothing(name, value):
    result = _manage("check", env=PRODUCTION_ENV | {name: value})
    assert result.returncode != 0
    assert name in result.stderr


def test_production_passes_check_deploy():
    result = _manage("check", "--deploy", "--fail-level", "WARNING", env=PRODUCTION_ENV)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_compose_file_is_valid_yaml_with_the_platform_services():
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    assert {"postgres", "redis", "gateway", "worker", "training-worker", "beat"} <= set(compose["services"])
    for name in ("gateway", "worker", "training-worker", "beat"):
        assert compose["services"][name]["build"]["dockerfile"] == "docker/platform.Dockerfile"
    trainer = compose["services"]["training-worker"]
    assert trainer["build"]["args"]["REQUIREMENTS"] == "training.txt" and "training" in trainer["command"]
    environment = compose["services"]["gateway"]["environment"]
    assert environment["EMAIL_BACKEND"].endswith("smtp.EmailBackend}") and "QUILT_ENGINE_TOKEN" in environment
    assert (REPO / "docker" / "platform.Dockerfile").exists()


def test_the_gateway_keeps_idle_connections_longer_than_load_balancers_do():
    # A server that closes an idle connection as a client or proxy reuses it resets that request (uvicorn's default
    # is 5 s; common load balancers keep idle connections 60 s).
    command = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())["services"]["gateway"]["command"]
    assert "--timeout-keep-alive" in command
    assert int(command[command.index("--timeout-keep-alive") + 1]) > 60


def test_the_platform_image_serves_as_the_deployed_gateway_does():
    # `docker run` of the platform image with its own command must serve what compose's and Kubernetes's gateway
    # serve: gateway.asgi (the inference fast path, and the ASGI lifespan that gives admission leases back at
    # shutdown) under uvicorn's httptools protocol on uvloop, with idle connections kept past a load balancer's. It ran
    # quilt.asgi under uvicorn's defaults, so an image started without compose's command served neither.
    deployed = _deployed_gateway_commands()
    command, gateway = deployed["image"], deployed["compose"]
    assert command[command.index("-m") + 2] == "gateway.asgi:application"
    assert command[command.index("--http") + 1] == "httptools"
    assert command[command.index("--loop") + 1] == "uvloop"
    assert int(command[command.index("--timeout-keep-alive") + 1]) > 60
    assert command == gateway


def _deployed_gateway_commands() -> dict[str, list[str]]:
    """The gateway's command in each place it is deployed: compose, Kubernetes, and the platform image's own CMD."""
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())["services"]["gateway"]["command"]
    deployment = next(document for document in yaml.safe_load_all((REPO / "docker" / "k8s" / "gateway.yaml").read_text())
                      if document["kind"] == "Deployment")  # fmt: skip
    containers = deployment["spec"]["template"]["spec"]["containers"]
    kubernetes = next(container["command"] for container in containers if container["name"] == "gateway")
    line = next(line for line in (REPO / "docker" / "platform.Dockerfile").read_text().splitlines()
                if line.startswith("CMD "))  # fmt: skip
    return {"compose": compose, "kubernetes": kubernetes, "image": json.loads(line.removeprefix("CMD "))}


def test_the_deployed_gateway_is_served_as_its_benchmark_measures_it():
    # uvicorn writes an access line per request unless told not to: a formatted record and a write to stdout each,
    # 5-36 % more of the gateway's CPU per request than benchmarks/gateway_overhead.py measures (it serves the
    # gateway with --no-access-log), so the deployed gateways run with it too; the request
    # log keeps every request the gateway answers, refusals included, under its x-request-id.
    from benchmarks.gateway_overhead import GATEWAY_SERVER_OPTIONS

    for place, command in _deployed_gateway_commands().items():
        for option, value in GATEWAY_SERVER_OPTIONS:
            assert option in command, (place, option)
            if value is not None:
                assert command[command.index(option) + 1] == value, (place, option)
        assert "--access-log" not in command, place
