"""GET /health and /v1/health: no key, 200 when the gateway can serve, else 503 naming what failed (gateway.health)."""

from django.http import HttpResponseNotAllowed, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from gateway.health import gateway_health


@csrf_exempt
async def health(request):
    """{"status": "ok" | "unavailable", "failed": [names], "checks": {name: {"ok", "detail"}}}, never cached."""
    if request.method not in ("GET", "HEAD"):
        return HttpResponseNotAllowed(["GET", "HEAD"])
    ok, checks = await gateway_health()
    body = {
        "status": "ok" if ok else "unavailable",
        "failed": [name for name, check in checks.items() if not check.ok],
        "checks": {name: check.body() for name, check in checks.items()},
    }
    response = JsonResponse(body, status=200 if ok else 503)
    response["Cache-Control"] = "no-store"
    return response
