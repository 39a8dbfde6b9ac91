"""Refusals a caller can cause, each with the HTTP status, short code and parameter the API answers with."""


class FineTuningRefusal(Exception):
    def __init__(self, message: str, *, code: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status
        self.param = param


def not_found(what: str, public_id: str, *, param: str | None = None) -> FineTuningRefusal:
    return FineTuningRefusal(f"No such {what}: '{public_id}'.", code="not_found", status=404, param=param)
