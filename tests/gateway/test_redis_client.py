"""Admission's Redis client against a real Redis: each call's own reply at 50 at once, scripts loaded again after
SCRIPT FLUSH, a Redis restarted mid-run reconnected, a paused one a timeout within the reply timeout rather than a
wait for ever, and each running loop on its own connections."""

import asyncio
import os
import signal
import threading
import time
import uuid

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.admission.limits import Limits
from gateway.admission.redis_backend import RedisAdmission
from gateway.admission.redis_client import ScriptCalls, loop_client
from gateway.connections import STORE_DOWN

URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379") + "/13"
ECHO = "if ARGV[2] == 'fail' then return redis.error_reply('failed ' .. ARGV[1]) end return {ARGV[1], KEYS[1], #ARGV}"
STREAMS = 50


def _calls(url: str = URL, reply_seconds: float = 5.0) -> tuple[ScriptCalls, object]:
    echo = loop_client(url, reply_seconds=reply_seconds).register_script(ECHO)  # its SHA and source
    return ScriptCalls(url, reply_seconds=reply_seconds), echo


@pytest.fixture
def prefix():
    name = f"quilt-client-test-{uuid.uuid4().hex[:8]}"
    yield name
    client = redis.Redis.from_url(URL)
    for key in client.scan_iter(match=f"{name}:*"):
        client.delete(key)


def test_fifty_calls_at_once_each_get_their_own_reply_or_error():
    """Calls made while one is in flight go to Redis together; each is answered with its own reply, and an error
    Redis answers to one is raised by that call alone."""

    async def main():
        calls, echo = _calls()

        async def one(number: int, rounds: int):
            replies = []
            for round_ in range(rounds):
                fail = number % 7 == 3 and round_ == 1
                try:
                    replies.append(await calls(echo, [f"k{number}"], [f"{number}.{round_}", "fail" if fail else ""]))
                except ResponseError as error:
                    replies.append(str(error))
            return replies

        return await asyncio.gather(*(one(number, 4) for number in range(STREAMS)))

    for number, replies in enumerate(asyncio.run(main())):
        for round_, reply in enumerate(replies):
            if number % 7 == 3 and round_ == 1:
                assert reply == f"failed {number}.{round_}"
            else:
                assert reply == [f"{number}.{round_}".encode(), f"k{number}".encode(), 2]


def test_fifty_requests_at_once_are_admitted_exactly_to_the_limit(prefix):
    """50 acquires at once against a limit of 30 concurrent requests: 30 admitted, 20 refused for concurrency; settled,
    nothing is held."""
    limits = Limits(1000, 10**9, 30, -1, -1)
    redis.Redis.from_url(URL).hset(f"{prefix}:{{t1}}:month:{_month()}", mapping={"tokens": 0, "picos": 0})

    async def main():
        admission = RedisAdmission(url=URL, prefix=prefix, hold_ttl_seconds=900)
        decisions = await asyncio.gather(*(
            admission.acquire(tenant_id=1, request_id=f"r{number}", tokens=10, spend_micros=1, key_spend_picos=0,
                              limits=limits)
            for number in range(STREAMS)))  # fmt: skip
        settled = await asyncio.gather(*(
            admission.settle(tenant_id=1, request_id=f"r{number}", tokens=10, spend_micros=1, key_spend_picos=0,
                             final=True)
            for number, decision in enumerate(decisions) if decision.admitted))  # fmt: skip
        return decisions, settled, admission

    decisions, settled, admission = asyncio.run(main())
    assert sum(decision.admitted for decision in decisions) == 30
    assert {decision.reason for decision in decisions if not decision.admitted} == {"concurrency"}
    assert settled == [True] * 30  # each released a live hold
    assert admission.totals(tenant_id=1).live_holds == 0


def _month() -> str:
    from gateway.admission.limits import current_month

    return current_month()


def test_scripts_are_loaded_again_after_script_flush():
    """A Redis that lost its script cache (SCRIPT FLUSH, a restart): the next call, alone or with others, is answered."""
    flush = redis.Redis.from_url(URL).script_flush

    async def main():
        calls, echo = _calls()
        first = await calls(echo, ["k"], ["a", ""])
        flush()
        alone = await calls(echo, ["k"], ["b", ""])
        flush()
        together = await asyncio.gather(*(calls(echo, ["k"], [str(number), ""]) for number in range(10)))
        return first, alone, together

    first, alone, together = asyncio.run(main())
    assert first[0] == b"a" and alone[0] == b"b"
    assert [reply[0] for reply in together] == [str(number).encode() for number in range(10)]


def test_a_redis_restarted_mid_run_is_reconnected(private_redis):
    """While Redis is down a call fails at once with an error the API answers as 503 (STORE_DOWN); once it is back,
    the next call is answered on a new connection."""

    async def main():
        calls, echo = _calls(private_redis.url)
        before = await calls(echo, ["k"], ["1", ""])
        private_redis.stop()
        started = time.monotonic()
        with pytest.raises(STORE_DOWN) as down:
            await calls(echo, ["k"], ["2", ""])
        failed_after = time.monotonic() - started
        private_redis.start()
        after = await calls(echo, ["k"], ["3", ""])
        return before, down.value, failed_after, after

    before, down, failed_after, after = asyncio.run(main())
    assert before[0] == b"1" and after[0] == b"3"
    assert isinstance(down, RedisConnectionError)
    assert failed_after < 2.0


def test_a_paused_redis_is_a_timeout_within_the_reply_timeout(private_redis):
    """A Redis that keeps its connections and never answers (SIGSTOP: a stalled failover, a partition without resets)
    fails the call in flight and those waiting for their turn with redis-py's TimeoutError after `reply_seconds`,
    never a wait for ever; once it answers again, so do the calls."""

    async def main():
        calls, echo = _calls(private_redis.url, reply_seconds=0.5)
        assert (await calls(echo, ["k"], ["1", ""]))[0] == b"1"
        private_redis.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            outcomes = await asyncio.wait_for(asyncio.gather(
                *(calls(echo, ["k"], [str(number), ""]) for number in range(5)), return_exceptions=True), 10)  # fmt: skip
            waited = time.monotonic() - started
        finally:
            private_redis.process.send_signal(signal.SIGCONT)
        after = await calls(echo, ["k"], ["2", ""])
        return outcomes, waited, after

    outcomes, waited, after = asyncio.run(main())
    assert all(isinstance(outcome, RedisTimeoutError) for outcome in outcomes), outcomes
    assert isinstance(outcomes[0], STORE_DOWN)
    assert 0.5 <= waited < 2.0
    assert after[0] == b"2"


def test_each_running_loop_gets_its_own_connections():
    """Loops one after another in one thread, and two at once in two threads: each script runs on connections of the
    loop that awaits it (a future of another loop would fail the await)."""
    admission = RedisAdmission(url=URL, prefix=f"quilt-loops-{uuid.uuid4().hex[:8]}", hold_ttl_seconds=900)
    both_running = threading.Barrier(2)
    failures: list[BaseException] = []

    async def peeks(wait: bool):
        for number in range(5):
            assert (await admission.peek(tenant_id=1)).reason == "ok"
            if number == 0 and wait:
                await asyncio.to_thread(both_running.wait, 5)

    def in_thread():
        try:
            asyncio.run(peeks(True))
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            failures.append(error)

    asyncio.run(peeks(False))
    asyncio.run(peeks(False))  # the last loop closed: a new loop, a new client
    threads = [threading.Thread(target=in_thread) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert failures == []
