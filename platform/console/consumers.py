"""Websocket consumers behind the console's live updates.

- TenantConsumer (/ws/t/<slug>/): joins the tenant's Channels group; each "adapter.status" message the registry
  sends, "usage.recorded" (metering wrote requests) and "fine_tuning.progress" (console.live_tenant) tell the page
  to re-fetch its live regions. Only members of the tenant (or staff) may connect.
- EnginesConsumer (/ws/engines/, staff): pushes the engines grid, rendered on the server, whenever an engine's
  row changes (the health check saves it: console.live_engines pushes), looks again when the next self-registered
  engine's heartbeats run out (a killed engine writes nothing: it is down from then on, gateway.models.engine_up),
  and every ENGINES_SAFETY_SECONDS for writes that bypass signals.
"""

import asyncio

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.http import Http404

from console.access import seat_for
from console.live_engines import ENGINES_GROUP
from console.views.engines import engines_grid_html, seconds_to_next_expiry
from registry.broadcast import tenant_group

ENGINES_SAFETY_SECONDS = 15.0
EXPIRY_SLACK_SECONDS = 0.05  # look just after the expiry, not just before it
FORBIDDEN = 4403


async def refuse(consumer: AsyncJsonWebsocketConsumer) -> None:
    """Accept, then close with FORBIDDEN. A close before the handshake completes reaches the browser as an HTTP 403
    and close code 1006, which it can't tell from a dropped network; 4403 tells console.js to stop retrying."""
    await consumer.accept()
    await consumer.close(code=FORBIDDEN)


@database_sync_to_async
def _tenant_id_for(user, slug: str) -> int | None:
    if not user.is_authenticated:
        return None
    try:
        return seat_for(user=user, slug=slug).tenant.pk
    except Http404:
        return None


class TenantConsumer(AsyncJsonWebsocketConsumer):
    group = ""

    async def connect(self):
        tenant_id = await _tenant_id_for(self.scope["user"], self.scope["url_route"]["kwargs"]["slug"])
        if tenant_id is None:
            await refuse(self)
            return
        self.group = tenant_group(tenant_id)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()

    async def disconnect(self, code):
        if self.group:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def adapter_status(self, event):
        fields = ("adapter", "version", "status", "message")
        await self.send_json({"type": "refresh", "event": {name: event.get(name) for name in fields}})

    async def usage_recorded(self, event):
        await self.send_json({"type": "refresh", "event": {"type": "usage.recorded"}})

    async def fine_tuning_progress(self, event):
        await self.send_json({"type": "refresh", "event": {"type": "fine_tuning.progress"}})


class EnginesConsumer(AsyncJsonWebsocketConsumer):
    task: asyncio.Task | None = None
    last_html: str | None = None
    joined = False

    async def connect(self):
        user = self.scope["user"]
        if not (user.is_authenticated and user.is_staff):
            await refuse(self)
            return
        self.lock = asyncio.Lock()
        await self.channel_layer.group_add(ENGINES_GROUP, self.channel_name)
        self.joined = True
        await self.accept()
        self.task = asyncio.create_task(self._safety_net())

    async def disconnect(self, code):
        if self.task is not None:
            self.task.cancel()
        if self.joined:
            await self.channel_layer.group_discard(ENGINES_GROUP, self.channel_name)

    async def engines_changed(self, event):
        await self._send_if_changed()

    async def _send_if_changed(self):
        async with self.lock:
            html = await database_sync_to_async(engines_grid_html)()
            if html != self.last_html:
                await self.send_json({"type": "html", "target": "engines-grid", "html": html})
                self.last_html = html

    async def _safety_net(self):
        while True:
            await self._send_if_changed()
            expiry = await database_sync_to_async(seconds_to_next_expiry)()
            wait = ENGINES_SAFETY_SECONDS if expiry is None else min(ENGINES_SAFETY_SECONDS, expiry + EXPIRY_SLACK_SECONDS)
            await asyncio.sleep(wait)
