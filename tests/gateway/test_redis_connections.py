"""The gateway's connections to Redis are kept and reused, not opened per request. Counted on a private
redis-server (the shared one has other clients), from its own tally of connections received."""


import httpx
import pytest
import redis

from tests.gateway.conftest import free_port, launch_gateway, stop, wait_for_gateway

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

LOOKUPS = 30


def test_key_lookups_reuse_the_caches_redis_connections(stack, private_redis, tmp_path):
    """Every key lookup (once a second per key for inference, every time for /v1/models) marks the key used
    through Django's cache. Django makes a cache object per request context, and its Redis backend a pool per
    object: a new Redis connection per lookup, which a busy gateway turned into thousands a minute."""
    port = free_port()
    gateway = launch_gateway(stack.env | {"REDIS_URL": private_redis.url}, port, tmp_path / "gateway.log")
    try:
        wait_for_gateway(gateway)
        headers = {"Authorization": f"Bearer {stack.keys['main']}"}
        url = f"http://127.0.0.1:{port}/v1/models"
        assert httpx.get(url, headers=headers).status_code == 200  # the gateway's lasting connections are made
        server = redis.Redis.from_url(private_redis.url)
        before = server.info("stats")["total_connections_received"]
        for _ in range(LOOKUPS):
            assert httpx.get(url, headers=headers).status_code == 200
        opened = server.info("stats")["total_connections_received"] - before
        assert opened <= 2, f"{opened} Redis connections opened for {LOOKUPS} key lookups"
    finally:
        stop(gateway)
