"""The browser tests' live server at the end of a test: whatever the test left in flight ends before the test
database is flushed, so the flush meets no lock of the server's and the next test starts on an empty database."""

import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

BODY_PAUSE_S = 2.0


@pytest.fixture
def checked_after_the_flush():
    """Set up before the test database, so torn down after its flush: by then the request the test left in
    flight must have had its answer."""
    left = {}
    yield left
    assert not left["client"].is_alive(), "the test database was flushed while a request was still in flight"
    assert left["answer"] == 403  # a login without its CSRF token, answered once its slow body had arrived


def test_a_request_still_in_flight_when_the_test_ends_is_answered_before_the_flush(
    checked_after_the_flush, transactional_db, live_server_asgi
):
    body = b"username=nobody&password=wrong-password-1"
    first_half_sent = threading.Event()

    def slowly():
        yield body[:10]
        first_half_sent.set()
        time.sleep(BODY_PAUSE_S)
        yield body[10:]

    def post() -> None:
        headers = {"Content-Type": "application/x-www-form-urlencoded", "Content-Length": str(len(body))}
        answer = httpx.post(live_server_asgi.url + "/login/", content=slowly(), headers=headers, timeout=30)
        checked_after_the_flush["answer"] = answer.status_code

    client = threading.Thread(target=post)
    client.start()
    checked_after_the_flush["client"] = client
    assert first_half_sent.wait(timeout=30)
