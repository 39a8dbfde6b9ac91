"""The web server's end of the live relay (see registry.broadcast): another process of this platform posts a
channel-layer message here and it is pushed to this server's websockets. Only tenant groups with the
adapter-status message, and the engines group with its change note, are accepted, with the relay token
derived from SECRET_KEY."""

import json

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.http import HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from console.live_engines import ENGINES_GROUP, ENGINES_MESSAGE
from registry.broadcast import RELAY_GROUP_PREFIX, relay_token_valid

RELAYED_TYPES = {"adapter.status", "usage.recorded", "fine_tuning.progress"}
FIELDS = ("type", "adapter", "version", "status", "message")


@csrf_exempt
@require_POST
def live_relay(request):
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme != "Bearer" or not relay_token_valid(token):
        return JsonResponse({"error": "forbidden"}, status=403)
    try:
        body = json.loads(request.body)
        group, message = body["group"], body["message"]
    except (ValueError, KeyError, TypeError):
        return JsonResponse({"error": "expected {group, message}"}, status=400)
    if group == ENGINES_GROUP and message == {"type": ENGINES_MESSAGE}:
        async_to_sync(get_channel_layer().group_send)(ENGINES_GROUP, {"type": ENGINES_MESSAGE})
        return HttpResponse(status=204)
    tenant_group = isinstance(group, str) and group.startswith(RELAY_GROUP_PREFIX) and group[len(RELAY_GROUP_PREFIX):].isdigit()
    if not (tenant_group and isinstance(message, dict) and message.get("type") in RELAYED_TYPES):
        return JsonResponse({"error": "not a relayed message"}, status=400)
    async_to_sync(get_channel_layer().group_send)(group, {name: message.get(name) for name in FIELDS})
    return HttpResponse(status=204)
