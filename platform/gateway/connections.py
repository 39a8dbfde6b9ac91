"""Database connections on the gateway's own threads (the admission thread, the executor threads), which live
outside Django's request cycle and so never get their connection checked or replaced by it.

`checked_connection(function)` closes the thread's connection first if it is unusable or past its age, runs the
function, and once more on a fresh connection if the old one had died (a PostgreSQL restart). If the database is
still away the error propagates; the API answers it with a 503 and Retry-After (see `asgi`)."""

import functools

from django.db import InterfaceError, OperationalError, connection

DATABASE_DOWN = (OperationalError, InterfaceError)


def checked_connection(function):
    @functools.wraps(function)
    def run(*args, **kwargs):
        if not connection.in_atomic_block:
            connection.close_if_unusable_or_obsolete()
        try:
            return function(*args, **kwargs)
        except DATABASE_DOWN:
            if connection.in_atomic_block:
                raise  # the caller's transaction is lost; only it can start again
            connection.close()
            return function(*args, **kwargs)

    return run
