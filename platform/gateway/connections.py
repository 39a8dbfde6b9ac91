"""Database connections on the gateway's own threads (the admission thread, the executor threads), which live
outside Django's request cycle and so never get their connection checked or replaced by it.

`checked_connection(function)` runs the function, and once more on a fresh connection if the thread's connection
had died (a PostgreSQL restart, an idle timeout): the failed use is the check, so a healthy connection costs
nothing extra (a ping before each use would cost a round trip; closing by CONN_MAX_AGE would reconnect per call
when it is 0). If the database is still away the error propagates; the API answers it with a 503 and
Retry-After (see `asgi`)."""

import functools

from django.db import InterfaceError, OperationalError, connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

DATABASE_DOWN = (OperationalError, InterfaceError)
STORE_DOWN = (*DATABASE_DOWN, RedisConnectionError, RedisTimeoutError)  # the database's, or Redis's


def checked_connection(function):
    @functools.wraps(function)
    def run(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except DATABASE_DOWN:
            if connection.in_atomic_block:
                raise  # the caller's transaction is lost; only it can start again
            connection.close()
            return function(*args, **kwargs)

    return run
