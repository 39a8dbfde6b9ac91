"""The control plane's internal API for engines (not for clients): self-registration and heartbeats, authenticated
by the engine token that gateways use to call engines (QUILT_ENGINE_TOKEN). A heartbeat is the contract's
`Heartbeat` (engine.contract.state): one this side cannot read is a 400 naming the field or the version, and the
engine of that name leaves routing until it sends one it can."""

import hmac
import json

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from engine.contract import Heartbeat, state_read
from gateway.services import HeartbeatRefused, engine_heartbeat, engine_state_refused


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JsonResponse:
    return JsonResponse({"error": {"type": kind, "message": message, "param": None}}, status=status)


def _authorized(request: HttpRequest) -> bool:
    expected = settings.QUILT_ENGINE_TOKEN
    given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    return bool(expected) and hmac.compare_digest(given.encode(), expected.encode())


@csrf_exempt
@require_POST
def heartbeat(request: HttpRequest) -> JsonResponse:
    if not _authorized(request):
        return _error(401, "a heartbeat must carry the engine token (Authorization: Bearer ...)", "authentication_error")
    try:
        body = json.loads(request.body)
    except (ValueError, UnicodeDecodeError) as error:
        return _error(400, f"the body is not JSON: {error}")
    try:
        beat = state_read(body, Heartbeat)
    except ValueError as error:  # BadState naming the field, or WrongVersion naming the version
        name = body.get("name") if isinstance(body, dict) else None
        if isinstance(name, str):
            engine_state_refused(name=name, message=f"{type(error).__name__}: {error}")
        return _error(400, str(error))
    try:
        engine = engine_heartbeat(heartbeat=beat)
    except HeartbeatRefused as refused:
        return _error(refused.status, str(refused))
    return JsonResponse({"name": engine.name, "routed": engine.healthy,
                         "expires_at": engine.heartbeat_expires_at.isoformat()})
