"""What the tests of the gateway's engine client share: each runs on asyncio's loop and on uvloop, and reads a
generate stream to its end."""

import asyncio

import uvloop

from engine.contract import Final
from gateway.engine_client import GenerateStream

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def run(main, loop: str):
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        return runner.run(main())


async def read_all(stream: GenerateStream) -> list:
    seen = []
    while (events := await stream.events()) is not None:
        seen += events
        stream.finished = stream.finished or any(isinstance(event, Final) for event in events)
    return seen
