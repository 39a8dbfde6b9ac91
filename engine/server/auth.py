"""Every call carries `Authorization: Bearer <token>`, the secret shared with the gateway."""

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send


class BearerAuth:
    def __init__(self, app: ASGIApp, *, token: str) -> None:
        if not token:
            raise ValueError("the engine needs a bearer token")
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # refused before the handshake: the server answers it 403
            await send({"type": "websocket.close", "code": 1008})
            return
        message = "missing bearer token" if not given else "invalid bearer token"
        body = json.dumps({"error": {"type": "authentication_error", "message": message, "param": None}}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="quilt-engine"'),
        ]})
        await send({"type": "http.response.body", "body": body})
