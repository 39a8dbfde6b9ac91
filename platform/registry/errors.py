"""Refusals a caller can cause, each with the HTTP status and short code the API answers with."""


class RegistryRefusal(Exception):
    status_code = 400

    def __init__(self, message: str, *, code: str, status_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        if status_code is not None:
            self.status_code = status_code


class PlanLimitReached(RegistryRefusal):
    status_code = 403


class UploadTooLarge(RegistryRefusal):
    status_code = 413
