"""Whether this gateway can serve: its database answers, Redis answers (where REDIS_URL is set) and at least one
engine that routing would use answers its own /v1/health. Load balancers and load tools (guidellm) ask `GET /health`
before they send anything. The checks run at once, each bounded by CHECK_SECONDS; a failure is named in words that
say what failed, never the store's address or credentials (the answer needs no key), and logged in full here."""

import asyncio
import logging
from dataclasses import dataclass

import httpx
import redis.asyncio
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection

from gateway.connections import DATABASE_DOWN, checked_connection
from gateway.engine_client import EngineRef
from gateway.routing import engines_refresh, router

log = logging.getLogger(__name__)

CHECK_SECONDS = 2.0


@dataclass
class Check:
    ok: bool
    detail: str

    def body(self) -> dict:
        return {"ok": self.ok, "detail": self.detail}


def _database_ping() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


_ping_database = sync_to_async(checked_connection(_database_ping), thread_sensitive=False)


async def _database() -> Check:
    try:
        await asyncio.wait_for(_ping_database(), CHECK_SECONDS)
    except (*DATABASE_DOWN, TimeoutError) as error:
        log.warning("health: the database is unreachable: %r", error)
        return Check(False, "The database is unreachable.")
    return Check(True, "The database answers.")


async def _redis() -> Check:
    if not settings.REDIS_URL:
        return Check(True, "Not configured: admission runs in the database.")
    client = redis.asyncio.Redis.from_url(settings.REDIS_URL, socket_timeout=CHECK_SECONDS,
                                          socket_connect_timeout=CHECK_SECONDS)  # fmt: skip
    try:
        await asyncio.wait_for(client.ping(), CHECK_SECONDS)
    except (redis.RedisError, OSError, TimeoutError) as error:
        log.warning("health: Redis is unreachable: %r", error)
        return Check(False, "Redis is unreachable.")
    finally:
        await client.aclose()
    return Check(True, "Redis answers.")


async def _engine_answers(client: httpx.AsyncClient, engine: EngineRef) -> bool:
    token = engine.token or settings.QUILT_ENGINE_TOKEN
    try:
        response = await client.get(f"{engine.url}/v1/health", headers={"Authorization": f"Bearer {token}"})
    except httpx.HTTPError as error:
        log.warning("health: engine %s did not answer: %r", engine.name, error)
        return False
    if response.status_code != 200:
        log.warning("health: engine %s answered %s", engine.name, response.status_code)
    return response.status_code == 200


async def _engines() -> Check:
    """The engines routing would use (re-read as routing re-reads them; the last ones read while the database is
    away), each asked for its health."""
    try:
        await engines_refresh()
    except DATABASE_DOWN:
        pass  # none read yet: none to ask
    engines = router.engines()
    if not engines:
        return Check(False, "No engine is up: none is registered, enabled and healthy.")
    async with httpx.AsyncClient(timeout=CHECK_SECONDS) as client:
        answers = await asyncio.gather(*(_engine_answers(client, engine) for engine in engines))
    healthy = sum(answers)
    if not healthy:
        return Check(False, f"No engine answers healthy: 0 of {len(engines)} routable engines.")
    return Check(True, f"{healthy} of {len(engines)} routable engines answer healthy.")


async def gateway_health() -> tuple[bool, dict[str, Check]]:
    """(whether every check passed, each check by name: database, redis, engines)."""
    database, redis_check, engines = await asyncio.gather(_database(), _redis(), _engines())
    checks = {"database": database, "redis": redis_check, "engines": engines}
    return all(check.ok for check in checks.values()), checks
