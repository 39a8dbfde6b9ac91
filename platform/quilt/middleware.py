"""A NUL character in a URL's path or query string is refused with a 400 before any view runs: no name, id or
filter value holds one, and PostgreSQL refuses one in a query, which would otherwise fail the lookup as a 500.
(JSON bodies are checked field by field: DRF's CharField refuses NUL characters.) The /v1/ API is served without
the platform's middleware (gateway/asgi.py); its views that look ids up check for a NUL themselves."""

from django.http import HttpResponseBadRequest, JsonResponse

from quilt.api_errors import error_body, is_api

MESSAGE = "The URL holds a NUL character, which no name, id or filter value can hold."


def _holds_nul(request) -> bool:
    if "\x00" in request.path:
        return True
    return any("\x00" in name or any("\x00" in value for value in values) for name, values in request.GET.lists())


class RefuseNulInUrlMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if _holds_nul(request):
            if is_api(request):
                return JsonResponse(error_body(message=MESSAGE, status_code=400, code="invalid_url"), status=400)
            return HttpResponseBadRequest(MESSAGE)
        return self.get_response(request)
