"""The one exception a tenant sees when an adapter is refused."""


class AdapterError(ValueError):
    """An adapter that Quilt refuses, with a short machine-readable `code` and a message for the tenant."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"AdapterError({self.code!r}, {self.message!r})"
