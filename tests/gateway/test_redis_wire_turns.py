"""The lean Redis wire's bound on connections, driven step by step: at most `max_connections` commands at once, the
rest served first come first served, and a waiter that gives up (cancelled, or past `wait_seconds`) just as its turn
arrives passes it on, as asyncio.Semaphore's acquire did. No real Redis and no sleeps: each command's reply is a
future the test resolves, the loop is advanced one step at a time (`asyncio.sleep(0)`), and its clock is the test's."""

import asyncio
import random

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.admission.redis_wire import RedisWire, WireScript

SCRIPT = WireScript("return 1")
WAIT = 10.0


class _Redis:
    """Stands in for Redis behind the wire's connections: records each command (by the number it carries) when it
    goes out on a connection, and answers it when the test says so."""

    def __init__(self, wire: RedisWire, max_connections: int):
        self.max_connections = max_connections
        self.loop = asyncio.get_running_loop()
        self.now = 1000.0
        self.loop.time = lambda: self.now  # timeouts fire when the test moves the clock, and only then
        self.wire = wire
        self.commands: dict[int, asyncio.Task] = {}
        self.asked: list[int] = []  # the commands, in the order they went out
        self.replies: dict[int, asyncio.Future] = {}  # those not answered yet
        self.most = 0  # the most commands on a connection at once
        self.opened = 0
        wire._open = self._open

    async def _open(self):
        self.opened += 1
        return _Connection(self)

    def start(self, number: int) -> asyncio.Task:
        self.commands[number] = asyncio.create_task(self.wire.run(SCRIPT, [], [number]))
        return self.commands[number]

    def sent(self, message: bytes, reply: asyncio.Future) -> None:
        """A command went out on a connection; `reply`: the future the wire awaits for its answer."""
        number = int(message.rsplit(b"\r\n", 2)[-2])
        self.asked.append(number)
        self.most = max(self.most, sum(not self.commands[asked].done() for asked in self.asked))
        self.replies[number] = reply

    def answer(self, number: int) -> None:
        reply = self.replies.pop(number)
        if not reply.done():  # not cancelled with its command
            reply.set_result(number)

    async def finish(self) -> dict[int, object]:
        """Answers every command still on a connection until all are done, without moving the clock: a turn lost
        on the way leaves its waiters stuck, which fails here."""
        for _ in range(1000):
            if all(command.done() for command in self.commands.values()):
                break
            for number in list(self.replies):
                self.answer(number)
            await asyncio.sleep(0)
        outcomes = {}
        for number, command in self.commands.items():
            assert command.done(), f"command {number} never got a connection: a turn was lost"
            outcomes[number] = (
                asyncio.CancelledError() if command.cancelled() else command.exception() or command.result()
            )
        return outcomes

    def assert_all_free(self) -> None:
        assert all(reply.done() for reply in self.replies.values())
        assert self.wire._free == self.max_connections
        assert not self.wire._turns  # no waiter left in line


class _Connection:
    """As the wire's own connection is used: the wire sets `_waiter` to a future of `loop`, then writes the command
    to `transport`."""

    def __init__(self, redis: _Redis):
        self.redis, self.transport, self.loop = redis, self, redis.loop
        self.lost = self.transport_closing = self.closed = False  # lost: as the wire's own connection marks it
        self._waiter: asyncio.Future | None = None

    def write(self, message: bytes) -> None:
        self.redis.sent(message, self._waiter)

    def is_closing(self) -> bool:
        return self.transport_closing or self.closed

    def close(self) -> None:
        self.lost = self.closed = True



def _wire_and_redis(max_connections: int) -> tuple[RedisWire, _Redis]:
    wire = RedisWire("redis://127.0.0.1:1/0", max_connections=max_connections, wait_seconds=WAIT)
    return wire, _Redis(wire, max_connections)


async def _steps(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def _one_busy_two_waiting() -> tuple[RedisWire, _Redis, list[asyncio.Future]]:
    """Command 0 on the only connection; 1 waiting since the clock's start, 2 since half its wait later."""
    wire, redis = _wire_and_redis(1)
    redis.start(0)
    redis.start(1)
    await _steps(2)
    redis.now += WAIT / 2
    redis.start(2)
    await _steps(2)
    assert redis.asked == [0] and len(wire._turns) == 2
    return wire, redis, list(wire._turns)


def test_a_waiter_cancelled_as_its_turn_arrives_passes_it_to_the_next():
    async def main():
        wire, redis, turns = await _one_busy_two_waiting()
        redis.answer(0)
        for _ in range(10):  # until command 0 has handed its connection to 1, which has not run yet
            await asyncio.sleep(0)
            if turns[0].done():
                break
        assert turns[0].done() and not turns[0].cancelled() and redis.asked == [0]
        redis.commands[1].cancel()
        outcomes = await redis.finish()
        redis.assert_all_free()
        return outcomes, redis.asked

    outcomes, asked = asyncio.run(main())
    assert asked == [0, 2]
    assert outcomes[0] == 0 and isinstance(outcomes[1], asyncio.CancelledError) and outcomes[2] == 2


def test_a_waiter_timing_out_as_its_turn_arrives_passes_it_to_the_next():
    async def main():
        wire, redis, turns = await _one_busy_two_waiting()
        redis.answer(0)  # in the same loop step as command 1's wait runs out:
        redis.now += WAIT / 2 + 0.001  # 1's turn is handed to it, and then its timeout cancels it
        outcomes = await redis.finish()
        redis.assert_all_free()
        return outcomes, redis.asked, turns

    outcomes, asked, turns = asyncio.run(main())
    assert turns[0].done() and not turns[0].cancelled(), "not the race: 1 timed out before its turn came"
    assert asked == [0, 2]
    assert outcomes[0] == 0 and outcomes[2] == 2
    assert isinstance(outcomes[1], RedisConnectionError) and "No connection available" in str(outcomes[1])


def test_a_waiter_cancelled_before_its_turn_takes_none():
    async def main():
        wire, redis, _ = await _one_busy_two_waiting()
        redis.commands[1].cancel()
        await _steps(2)
        assert len(wire._turns) == 1  # out of the line at once, not when a turn comes by
        redis.answer(0)
        outcomes = await redis.finish()
        redis.assert_all_free()
        return outcomes, redis.asked

    outcomes, asked = asyncio.run(main())
    assert asked == [0, 2] and isinstance(outcomes[1], asyncio.CancelledError)


@pytest.mark.parametrize("seed", range(40))
def test_many_waiters_cancelled_and_timing_out_at_random(seed):
    """Commands start, are answered, cancelled (waiting, handed a turn, or on a connection) and time out in a seeded
    random order: never more than max_connections at once, served in the order they came, none stuck at the end,
    and every connection free again."""
    rng = random.Random(seed)
    max_connections = rng.choice((1, 2, 3))

    async def main():
        wire, redis = _wire_and_redis(max_connections)
        for number in range(60):
            redis.start(number)
            for _ in range(rng.randint(0, 3)):
                action = rng.random()
                unfinished = [command for command in redis.commands.values() if not command.done()]
                if action < 0.4 and redis.replies:
                    redis.answer(rng.choice(sorted(redis.replies)))
                elif action < 0.6 and unfinished:
                    rng.choice(unfinished).cancel()
                elif action < 0.7:
                    redis.now += rng.uniform(0, WAIT)
                await _steps(rng.randint(0, 2))
        outcomes = await redis.finish()
        redis.assert_all_free()
        return outcomes, redis.asked, redis.most

    outcomes, asked, most = asyncio.run(main())
    assert most <= max_connections
    assert asked == sorted(asked), "not first come first served"
    for number, outcome in outcomes.items():
        if number in asked:
            assert outcome == number or isinstance(outcome, asyncio.CancelledError)
        else:
            assert isinstance(outcome, asyncio.CancelledError | RedisConnectionError), outcome
    kinds = {type(outcome) for outcome in outcomes.values()}
    assert int in kinds and asyncio.CancelledError in kinds


def test_closed_idle_connections_are_passed_over():
    """The most recently used idle connection goes first; one closed meanwhile is dropped for the next, and with
    none left open a new one is made."""

    async def main():
        wire, redis = _wire_and_redis(3)
        for number in range(3):  # three connections at once, then idle
            redis.start(number)
        await _steps(2)
        await redis.finish()
        first, second, third = wire._idle
        third.lost = True
        redis.start(3)
        await _steps(1)
        on_second = wire._idle[-1] is first and len(wire._idle) == 1  # 3 went out on the second: not idle now
        second.transport_closing = True
        redis.answer(3)
        await _steps(2)
        redis.start(4)  # the second is closing now, the first open
        await _steps(1)
        on_first = not wire._idle
        await redis.finish()
        first.lost = True
        redis.start(5)  # only the second and the first idle, both closed: a new one
        await _steps(1)
        made = not wire._idle and redis.opened == 4
        await redis.finish()
        return on_second, on_first, made, third.closed, second.closed, wire._idle

    on_second, on_first, made, third_closed, second_closed, idle = asyncio.run(main())
    assert on_second and on_first and made and third_closed and second_closed
    assert len(idle) == 1 and not idle[0].lost
