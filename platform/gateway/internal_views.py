"""The control plane's internal API for engines (not for clients): self-registration and heartbeats, authenticated
by the engine token that gateways use to call engines (QUILT_ENGINE_TOKEN)."""

import hmac
import json

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from gateway.services import HeartbeatRefused, engine_heartbeat

HEARTBEAT_FIELDS = {"name", "url", "pool", "gpu_price_per_hour", "interval_s", "draining", "role", "state"}


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
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    missing = sorted({"name", "url", "interval_s"} - body.keys())
    unknown = sorted(body.keys() - HEARTBEAT_FIELDS)
    if missing or unknown:
        return _error(400, f"missing fields: {missing}; unknown fields: {unknown}")
    if not isinstance(body["name"], str) or not isinstance(body["url"], str):
        return _error(400, "name and url must be strings")
    try:
        engine = engine_heartbeat(
            name=body["name"], url=body["url"], pool=str(body.get("pool") or "default"),
            gpu_price_per_hour=str(body.get("gpu_price_per_hour", "0")), interval_s=body["interval_s"],
            draining=bool(body.get("draining", False)), role=body.get("role", "both"), state=body.get("state") or {},
        )  # fmt: skip
    except HeartbeatRefused as refused:
        return _error(refused.status, str(refused))
    return JsonResponse({"name": engine.name, "routed": engine.healthy,
                         "expires_at": engine.heartbeat_expires_at.isoformat()})
