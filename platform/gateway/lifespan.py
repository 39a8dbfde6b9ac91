"""The gateway server's ASGI lifespan (`gateway.asgi`): nothing to do at start-up; at shutdown, once the server's
requests are done, the process gives back its admission leases (`gateway.admission.leases`), which would otherwise
stay held until their window's end and the hold TTL."""

import logging

from gateway.admission import admission_give_back

log = logging.getLogger(__name__)


async def lifespan(receive, send) -> None:
    """Answers the server's start and shutdown messages; the leases are given back before the shutdown's answer."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            try:
                await admission_give_back()
            except Exception:  # Redis gone: the leases expire
                log.exception("could not give back the admission leases")
            await send({"type": "lifespan.shutdown.complete"})
            return
