"""A bounded schemathesis run over the whole management API (/api/v1/), once with an API key and once with a
logged-in session, against a real uvicorn server: no server errors, and every answer matches the OpenAPI schema
(status codes, content types, bodies, headers). Prints the figures: requests made and server errors (from the
requests schemathesis recorded)."""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
from django.contrib.sessions.backends.db import SessionStore

from tests.platform.factories import MembershipFactory, TenantFactory, UserFactory, make_key
from tests.security.conftest import FIGURES
from tests.security.gateways import gateways

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
CHECKS = "all"  # every check schemathesis has; positive_data_acceptance's expected statuses are in schemathesis.toml
CSRF = "securitytestcsrftoken0123456789a"
CONFIG = Path(__file__).with_name("schemathesis.toml")
# Operations only platform staff may call: the key meets them with 403 alone.
STAFF_PATHS = "^/api/v1/(tenants|plans|audit|fleet|reports)(/|$)"


def _har_entries(path) -> list[dict]:
    return json.loads(path.read_text())["log"]["entries"] if path.exists() else []


def _session_cookie(user) -> str:
    session = SessionStore()
    session[SESSION_KEY], session[BACKEND_SESSION_KEY] = str(user.pk), "django.contrib.auth.backends.ModelBackend"
    session[HASH_SESSION_KEY] = user.get_session_auth_hash()
    session.create()
    return session.session_key


def _config(path, *, coverage_of: str) -> Path:
    """schemathesis.toml, with the coverage phase (edge values for every parameter: NUL, lone surrogates, bounds)
    left to this run for the operations `coverage_of` says, and to the other identity's run for the rest."""
    skip = "exclude-path-regex" if coverage_of == "staff" else "include-path-regex"
    path.write_text(f"{CONFIG.read_text()}\n[[operations]]\n{skip} = {json.dumps(STAFF_PATHS)}\n"
                    "phases.coverage.enabled = false\n")  # fmt: skip
    return path


def _schemathesis(schema_path, config, url: str, har, *headers: str, phases: str) -> subprocess.Popen:
    command = [
        str(Path(sys.executable).parent / "st"), "--config-file", str(config), "run", str(schema_path), "--url", url, "--checks", CHECKS, "--max-examples", "5", "--generation-deterministic",
        "--workers", "1", "--seed", "15", "--no-color", "--report", "har", "--report-har-path", str(har),
        "--include-path-regex", "^/api/v1/",  # the schema documents /v1 too; the OpenAI API has its own fuzz test
        "--phases", phases,
    ]  # fmt: skip
    for header in headers:
        command += ["-H", header]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=har.parent)


def test_schemathesis_finds_no_server_error_and_no_schema_mismatch(tmp_path):
    # Each identity in a tenant of its own, so that one run's stateful phase does not revoke the other's key.
    tenant = TenantFactory(slug="st-tenant")
    key_owner = MembershipFactory(tenant=tenant, role="owner").user
    _, plaintext = make_key(tenant, scopes=["admin"], created_by=key_owner, name="schemathesis")
    staff = UserFactory(username="st-staff", is_staff=True)
    MembershipFactory(tenant=TenantFactory(slug="st-staff"), role="owner", user=staff)
    cookie = _session_cookie(staff)
    with gateways(tmp_path, 2) as (urls, _):
        schema = httpx.get(f"{urls[0]}/api/schema/?format=json", headers={"Authorization": f"Bearer {plaintext}"})
        assert schema.status_code == 200
        schema_path = tmp_path / "schema.json"
        schema_path.write_bytes(schema.content)
        session_headers = [f"Cookie: sessionid={cookie}; csrftoken={CSRF}", f"X-CSRFToken: {CSRF}", f"Referer: {urls[0]}/"]
        # Both at once, each on its own server, about as long: the coverage phase runs once per operation, with the
        # key for the tenant's and with the session for staff's; fuzzing with the session; the stateful phase with
        # both. Every check runs on every request.
        started = {
            "API key": _schemathesis(
                schema_path, _config(tmp_path / "key.toml", coverage_of="tenant"), urls[1], tmp_path / "key.har",
                f"Authorization: Bearer {plaintext}", phases="examples,coverage,stateful",
            ),
            "session": _schemathesis(
                schema_path, _config(tmp_path / "session.toml", coverage_of="staff"), urls[0], tmp_path / "session.har",
                *session_headers, phases="examples,coverage,fuzzing,stateful",
            ),
        }  # fmt: skip
        runs = {name: (process.communicate(timeout=300)[0], process.returncode) for name, process in started.items()}
    exchanges = [entry for name in ("key", "session") for entry in _har_entries(tmp_path / f"{name}.har")]
    api_requests = [entry for entry in exchanges if "/api/v1/" in entry["request"]["url"]]
    server_errors = sorted({entry["request"]["url"] for entry in exchanges if entry["response"]["status"] >= 500})
    for name, (output, returncode) in runs.items():
        summary = [line for line in output.splitlines() if "generated" in line or "❌" in line]
        FIGURES.append(f"schemathesis ({name}): exit {returncode}; " + " / ".join(line.strip() for line in summary[-2:]))
    FIGURES.append(f"schemathesis: {len(api_requests)} requests to /api/v1/, {len(server_errors)} server errors")
    print("\n".join(FIGURES[-3:]))
    assert server_errors == []
    for name, (output, returncode) in runs.items():
        assert returncode == 0, f"{name}:\n{output[-6000:]}"
    assert len(api_requests) > 1000
