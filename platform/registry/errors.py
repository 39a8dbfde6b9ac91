"""Refusals a caller can cause, each with the HTTP status and short code the API answers with.

A refusal is a 422 unless it says otherwise: the request had the schema's shape (a name, a base model, a file) and
what it asks for can not be done, most often because the file's content is not an adapter. The few refusals the
schema itself states (a name outside its pattern) pass 400.
"""


class RegistryRefusal(Exception):
    status_code = 422

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
