"""One Redis connection pool per URL and options for the whole process, for Django's Redis cache.

Django makes a cache object per async context (each request the ASGI gateway serves), and its Redis backend a
connection pool per cache object: without this, every request that touched the cache opened a new connection.
django-redis shares pools the same way; Django's backend only lets a pool class be named."""

import threading

import redis

_pools: dict[tuple, "SharedConnectionPool"] = {}
_lock = threading.Lock()


class SharedConnectionPool(redis.ConnectionPool):
    @classmethod
    def from_url(cls, url: str, **options) -> "SharedConnectionPool":
        key = (cls, url, tuple(sorted((name, repr(value)) for name, value in options.items())))
        with _lock:
            pool = _pools.get(key)
            if pool is None:
                pool = _pools[key] = super().from_url(url, **options)
        return pool
