"""The console websockets: only members (or staff) hear a tenant's adapter events; only staff see engines."""

import asyncio
import json
import time
from decimal import Decimal

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from asgiref.testing import ApplicationCommunicator
from channels.layers import get_channel_layer
from channels.routing import URLRouter
from django.contrib.auth.models import AnonymousUser
from django.db import connection

from console.routing import websocket_urlpatterns
from engine.contract import Heartbeat
from gateway.models import Engine
from gateway.routing import routable_engines
from gateway.services import HEARTBEAT_MISSES, engine_heartbeat
from registry.broadcast import tenant_group
from tests.engine_states import engine_state, engine_state_json
from tests.platform.factories import MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def in_memory_layer(settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


class Socket(ApplicationCommunicator):
    """A websocket client for an ASGI app (channels.testing's own would import daphne, which we don't ship)."""

    def __init__(self, path: str, user):
        scope = {"type": "websocket", "path": path, "headers": [], "subprotocols": [], "user": user}
        super().__init__(URLRouter(websocket_urlpatterns), scope)

    async def connect(self) -> tuple[bool, int | None]:
        await self.send_input({"type": "websocket.connect"})
        answer = await self.receive_output(5)
        return answer["type"] == "websocket.accept", answer.get("code")

    async def receive_json_from(self, timeout: float) -> dict:
        answer = await self.receive_output(timeout)
        assert answer["type"] == "websocket.send", answer
        return json.loads(answer["text"])

    async def disconnect(self) -> None:
        await self.send_input({"type": "websocket.disconnect", "code": 1000})
        await self.wait(5)


def communicator(path: str, user) -> Socket:
    return Socket(path, user)


async def _member_hears_adapter_events(user, tenant_id: int, slug: str):
    socket = communicator(f"/ws/t/{slug}/", user)
    connected, _ = await socket.connect()
    assert connected
    await get_channel_layer().group_send(tenant_group(tenant_id), {
        "type": "adapter.status", "adapter": "support-bot", "version": 2, "status": "failed", "message": "rank too big",
    })  # fmt: skip
    message = await socket.receive_json_from(timeout=5)
    await socket.disconnect()
    return message


def test_a_member_hears_their_tenants_adapter_events(tenant, member_of):
    _, membership = member_of(tenant, "viewer")
    message = async_to_sync(_member_hears_adapter_events)(membership.user, tenant.pk, tenant.slug)
    assert message == {"type": "refresh", "event": {"adapter": "support-bot", "version": 2, "status": "failed",
                                                    "message": "rank too big"}}  # fmt: skip


async def _refused(path: str, user) -> int:
    """The close code the browser sees. A close before the handshake completes reaches it as an HTTP 403 and code
    1006, the same as a dropped network; so the server accepts, then closes with 4403 at once."""
    socket = communicator(path, user)
    accepted, _ = await socket.connect()
    assert accepted
    answer = await socket.receive_output(5)
    assert answer["type"] == "websocket.close", answer
    return answer["code"]


def test_strangers_and_anonymous_visitors_are_refused(tenant, other_tenant):
    stranger = MembershipFactory(tenant=other_tenant, role="owner").user
    assert async_to_sync(_refused)(f"/ws/t/{tenant.slug}/", stranger) == 4403
    assert async_to_sync(_refused)(f"/ws/t/{tenant.slug}/", AnonymousUser()) == 4403
    assert async_to_sync(_refused)("/ws/engines/", stranger) == 4403


async def _engines_pushes(user) -> list[dict]:
    socket = communicator("/ws/engines/", user)
    connected, _ = await socket.connect()
    assert connected
    first = await socket.receive_json_from(timeout=5)
    await sync_to_async(_engine_gets_busier, thread_sensitive=False)()
    second = await socket.receive_json_from(timeout=5)  # pushed on save: well before the 15 s safety look
    await socket.disconnect()
    return [first, second]


def _engine_gets_busier() -> None:
    """The health check recording new state (it saves the row); runs in a thread with its own connection."""
    try:
        engine = Engine.objects.get(name="gpu-a")
        engine.state = engine_state_json(running=9, waiting=1, kv_blocks_used=5, kv_blocks_free=5, kv_blocks_total=10)
        engine.save(update_fields=["state"])
    finally:
        connection.close()


def test_staff_get_the_engines_grid_and_its_changes(db):
    Engine.objects.create(name="gpu-a", url="http://10.0.0.5:8100", gpu_price_per_hour=Decimal(2), healthy=True,
                          state=engine_state_json(running=2))  # fmt: skip
    first, second = async_to_sync(_engines_pushes)(UserFactory(is_staff=True))
    assert first["type"] == "html" and first["target"] == "engines-grid"
    assert 'data-engine="gpu-a"' in first["html"] and '<strong data-testid="running">2</strong>' in first["html"]
    assert '<strong data-testid="running">9</strong>' in second["html"] and "5 of 10 blocks · 50%" in second["html"]


async def _relayed(user, tenant_id: int, slug: str, token: str) -> tuple[int, int, dict | None]:
    """A message posted to the web server's relay (as the demo's worker does) reaches the tenant's sockets."""
    from django.test import AsyncClient

    socket = communicator(f"/ws/t/{slug}/", user)
    connected, _ = await socket.connect()
    assert connected
    client = AsyncClient()
    body = {"group": tenant_group(tenant_id), "message": {
        "type": "adapter.status", "adapter": "support-bot", "version": 3, "status": "ready", "message": "",
    }}  # fmt: skip
    refused = await client.post("/internal/live-relay/", body, content_type="application/json",
                                headers={"Authorization": "Bearer not-the-token"})  # fmt: skip
    accepted = await client.post("/internal/live-relay/", body, content_type="application/json",
                                 headers={"Authorization": f"Bearer {token}"})  # fmt: skip
    message = await socket.receive_json_from(timeout=5)
    await socket.disconnect()
    return refused.status_code, accepted.status_code, message


def test_the_live_relay_pushes_what_another_process_posts_and_refuses_strangers(tenant, member_of):
    from registry.broadcast import relay_token

    _, membership = member_of(tenant, "viewer")
    refused, accepted, message = async_to_sync(_relayed)(membership.user, tenant.pk, tenant.slug, relay_token())
    assert (refused, accepted) == (403, 204)
    assert message == {"type": "refresh", "event": {"adapter": "support-bot", "version": 3, "status": "ready",
                                                    "message": ""}}  # fmt: skip


def test_a_status_change_is_relayed_to_the_web_server_over_http(tenant, settings, base_model, adapter_zips):
    """The worker's side: with QUILT_LIVE_RELAY_URL set, each status change is posted there (a real HTTP server
    here, recording what it receives)."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from django.core.files.uploadedfile import SimpleUploadedFile

    from registry.broadcast import relay_token
    from registry.services import adapter_create
    from tenancy.audit import Actor
    from tests.console.builders import BASE_NAME

    received = []

    class Recorder(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.headers["Authorization"], json.loads(body)))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    settings.QUILT_LIVE_RELAY_URL = f"http://127.0.0.1:{server.server_port}/internal/live-relay/"
    try:
        adapter_create(actor=Actor.system(), tenant=tenant, name="relayed", base_model=BASE_NAME, enqueue=False,
                       files=[SimpleUploadedFile("a.zip", adapter_zips[0])])  # fmt: skip
    finally:
        server.shutdown()
    assert received == [(f"Bearer {relay_token()}", {"group": tenant_group(tenant.pk), "message": {
        "type": "adapter.status", "adapter": "relayed", "version": 1, "status": "uploaded", "message": "",
    }})]  # fmt: skip


async def _engines_grid_until(user, wanted: str, timeout: float) -> tuple[str, str]:
    """The first grid pushed, and the first one after it that contains `wanted` (within `timeout` seconds)."""
    socket = communicator("/ws/engines/", user)
    connected, _ = await socket.connect()
    assert connected
    first = (await socket.receive_json_from(timeout=5))["html"]
    html = first
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while wanted not in html:
        html = (await socket.receive_json_from(timeout=max(0.01, deadline - loop.time())))["html"]
    await socket.disconnect()
    return first, html


def test_an_engine_whose_heartbeats_stop_shows_down_on_the_live_page_and_leaves_routing(db):
    """A SIGKILLed engine sends nothing more: no heartbeat, no row saved. The page says "down" once its heartbeats
    expire (HEARTBEAT_MISSES intervals), as routing drops it: one rule for both, pushed without any write."""
    interval = 0.4
    engine_heartbeat(heartbeat=Heartbeat(name="gpu-k", url="http://10.0.0.9:8100", gpu_price_per_hour="1",
                                         interval_s=interval, state=engine_state(running=1)))  # fmt: skip
    assert "gpu-k" in routable_engines().values_list("name", flat=True)
    started = time.monotonic()
    first, later = async_to_sync(_engines_grid_until)(UserFactory(is_staff=True), 'data-status="down"', timeout=5)
    assert 'data-status="healthy"' in first
    assert time.monotonic() - started <= HEARTBEAT_MISSES * interval + 1.5
    assert "gpu-k" not in routable_engines().values_list("name", flat=True)
    assert not Engine.objects.get(name="gpu-k").is_up
