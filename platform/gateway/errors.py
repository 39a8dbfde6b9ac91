"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the status a client expects."""

import json

from django.http import HttpResponse

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,  # noqa: A002 - OpenAI's field name
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = headers or {}
        self.caller = None  # the authenticated caller, once known: its rate-limit headers go on the response

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> HttpResponse:
        response = HttpResponse(json.dumps(self.body()), status=self.status, content_type="application/json")
        for name, value in self.headers.items():
            response[name] = value
        return response


def invalid(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def no_engine(message: str = "No engine can serve this model right now; try again shortly.") -> ApiError:
    return ApiError(503, message, code="engine_unavailable", headers={"Retry-After": "1"})


def adapter_unavailable(model: str) -> ApiError:
    """The engine could not load this model's adapter: this request only, retriable (the engine may recover it,
    or the tenant may promote a good version)."""
    return ApiError(
        503, f"The adapter of model '{model}' could not be loaded right now; please retry shortly.",
        code="adapter_unavailable", headers={"Retry-After": "2"},
    )  # fmt: skip


def service_unavailable() -> ApiError:
    """A store the API depends on (PostgreSQL, Redis) is briefly unreachable."""
    return ApiError(
        503, "The service is briefly unavailable; please retry shortly.", code="service_unavailable",
        headers={"Retry-After": "2"},
    )  # fmt: skip
