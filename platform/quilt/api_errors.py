"""Management-API errors as {"error": {"message", "type", "code"}} with the right status."""

from django.core.exceptions import PermissionDenied, RequestDataTooBig, ValidationError
from django.http import Http404, JsonResponse
from django.views import defaults
from rest_framework import exceptions, status
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.serializers import as_serializer_error
from rest_framework.views import exception_handler as drf_exception_handler

from tenancy.authority import NotAllowed

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_body(*, message: str, status_code: int, code: str) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status_code, "api_error"), "code": code}}


def _flatten(detail) -> str:
    if isinstance(detail, dict):
        parts = []
        for field, value in detail.items():
            text = _flatten(value)
            parts.append(text if field in ("non_field_errors", "detail") else f"{field}: {text}")
        return "; ".join(parts)
    if isinstance(detail, list):
        return " ".join(_flatten(item) for item in detail)
    return str(detail)


# A service's ValidationError whose code says it is no mistake in the input: the status that says what it is.
STATUS_BY_CODE = {"conflict": status.HTTP_409_CONFLICT, "invalid_invitation": status.HTTP_404_NOT_FOUND,
                  "expiry_past": status.HTTP_422_UNPROCESSABLE_ENTITY}


# Input of the declared shape that asks for what can not be done: a date range reversed or too long, a plan that
# does not exist. 422, so that a 400 always means the request breaks the schema (docs: the API's OpenAPI schema).
UNPROCESSABLE_CODES = {"invalid_range", "does_not_exist"}
CONFLICT_CODES = {"unique"}  # a name or slug another object holds: the object's state, not the input's shape


def _leaf_codes(codes) -> set[str]:
    if isinstance(codes, dict):
        return set().union(*(_leaf_codes(value) for value in codes.values())) if codes else {""}
    if isinstance(codes, list):
        return set().union(*(_leaf_codes(value) for value in codes)) if codes else {""}
    return {str(codes)}


class _Refused(exceptions.APIException):
    def __init__(self, detail, *, code: str, status_code: int) -> None:
        super().__init__(detail, code=code)
        self.status_code = status_code
        self.default_code = code  # the answer's code, whatever the detail's own


def exception_handler(exc, context):
    if isinstance(exc, NotAllowed):
        exc = exceptions.PermissionDenied(exc.message, code=exc.code)
    elif isinstance(exc, ValidationError) and getattr(exc, "code", None) in STATUS_BY_CODE:
        exc = _Refused(" ".join(exc.messages), code=exc.code, status_code=STATUS_BY_CODE[exc.code])
    elif isinstance(exc, ValidationError):  # a model's full_clean: each field's message with its code ("unique")
        exc = exceptions.ValidationError(as_serializer_error(exc))
    elif isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    if isinstance(exc, exceptions.ValidationError) and _leaf_codes(exc.get_codes()) <= UNPROCESSABLE_CODES:
        exc = _Refused(exc.detail, code=next(iter(_leaf_codes(exc.get_codes()))), status_code=422)
    elif isinstance(exc, exceptions.ValidationError) and _leaf_codes(exc.get_codes()) <= CONFLICT_CODES:
        exc = _Refused(exc.detail, code="conflict", status_code=409)
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    code = getattr(exc, "default_code", "error")
    if isinstance(exc, exceptions.APIException) and not isinstance(exc, _Refused):
        codes = _leaf_codes(exc.get_codes())  # one code, of the error or of every field it names: the answer's
        if len(codes) == 1 and "" not in codes:
            code = next(iter(codes))
    if response.status_code == status.HTTP_401_UNAUTHORIZED and code in ("not_authenticated", "authentication_failed"):
        code = "invalid_api_key" if code == "authentication_failed" else code
    body = error_body(message=_flatten(exc.detail), status_code=response.status_code, code=code)
    _answer_in_json(context.get("request"))
    return Response(body, status=response.status_code, headers=dict(response.items()))


def _answer_in_json(request) -> None:
    """An error is JSON whatever the success would have been (a CSV download's error too): a client reads the error
    shape, and a spreadsheet of one "error" cell hides the status."""
    if request is not None and getattr(request, "accepted_renderer", None) is not None \
            and request.accepted_renderer.format != "json":
        request.accepted_renderer, request.accepted_media_type = JSONRenderer(), JSONRenderer.media_type


def is_api(request) -> bool:
    return request.path.startswith(("/api/", "/v1/"))


def bad_request(request, exception=None):
    """What Django refuses before a view runs (a body past DATA_UPLOAD_MAX_MEMORY_SIZE, too many form fields): in
    the API's error shape for the APIs, the site's page elsewhere."""
    if not is_api(request):
        return defaults.bad_request(request, exception)
    if isinstance(exception, RequestDataTooBig):
        body = error_body(message="The request body is too large.", status_code=413, code="request_too_large")
        return JsonResponse(body, status=413)
    message = str(exception) if exception is not None and str(exception) else "Bad request."
    return JsonResponse(error_body(message=message, status_code=400, code="bad_request"), status=400)


def page_not_found(request, exception=None):
    """JSON for the APIs (a URL that matches no route, e.g. /api/v1/members/abc), the site's page elsewhere."""
    if is_api(request):
        return JsonResponse(error_body(message="Not found.", status_code=404, code="not_found"), status=404)
    return defaults.page_not_found(request, exception)


def server_error(request):
    if is_api(request):
        body = error_body(message="The server failed to handle this request.", status_code=500, code="internal_error")
        return JsonResponse(body, status=500)
    return defaults.server_error(request)
