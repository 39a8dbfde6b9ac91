"""Production serves /v1 under the same HTTPS policy as /api and the console, and keeps database connections
bounded under the ASGI server however many requests come (counted in pg_stat_activity)."""

import concurrent.futures

import httpx
import pytest
from django.db import connection

from registry.models import BaseModel
from tests.platform.factories import TenantFactory, make_key
from tests.security.conftest import FIGURES
from tests.security.gateways import gateways

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
PRODUCTION = {
    "DJANGO_SETTINGS_MODULE": "quilt.settings.production",
    "SECRET_KEY": "x7#kP2!vQ9zR4mL8wN3bT6yH1jF5dS0aG7cV2xZ9qW4eR8tY3uI6oP1",
    "ALLOWED_HOSTS": "127.0.0.1",
    "QUILT_ENGINE_TOKEN": "e" * 40,
    "EMAIL_BACKEND": "django.core.mail.backends.smtp.EmailBackend",
}


def test_plain_http_to_v1_is_redirected_like_api_and_https_answers_carry_hsts(tmp_path):
    with gateways(tmp_path, 1, **PRODUCTION) as (urls, _):
        for path in ("/v1/models", "/api/v1/tenant"):
            plain = httpx.get(urls[0] + path, headers={"Authorization": "Bearer nope.nope"})
            assert plain.status_code == 301, (path, plain.status_code)
            assert plain.headers["location"].startswith("https://127.0.0.1")
            secure = httpx.get(
                urls[0] + path, headers={"Authorization": "Bearer nope.nope", "X-Forwarded-Proto": "https"}
            )
            assert secure.status_code == 401 and secure.json()["error"]["code"] == "invalid_api_key"
            assert "max-age=31536000" in secure.headers["strict-transport-security"]


def _connections() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        return cursor.fetchone()[0]


def test_database_connections_stay_bounded_under_the_asgi_gateway(tmp_path):
    BaseModel.objects.create(name="tiny", checkpoint_dir="/nowhere", architecture="llama", config={}, max_context=64)
    tenant = TenantFactory(slug="sec-conns")
    _, inference = make_key(tenant, scopes=["inference"])
    _, admin = make_key(tenant, scopes=["admin"])
    requests = [("/v1/models", inference), ("/api/v1/tenant", admin), ("/api/v1/keys", admin), ("/v1/models/x", "a.b")]
    with gateways(tmp_path, 1) as (urls, _):
        before = _connections()

        def call(number: int) -> int:
            path, key = requests[number % len(requests)]
            return httpx.get(urls[0] + path, headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code

        counts = []
        for _round in range(2):
            with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
                statuses = list(pool.map(call, range(200)))
            assert set(statuses) <= {200, 401, 404}, statuses
            counts.append(_connections())
    FIGURES.append(f"database connections: {before} before, {counts[0]} after 200 requests, {counts[1]} after 400")
    assert counts[1] <= counts[0] + 2, counts  # no growth with the number of requests
    assert counts[1] - before <= 40
