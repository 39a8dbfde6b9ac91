"""What every parser of the internal API's bodies shares: the client-mistake error and the JSON type checks."""

from typing import Any


class BadRequest(ValueError):
    """A client mistake: answered with 400 and this message, before anything is scheduled."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code  # for the client to act on, e.g. engine.contract.CONTEXT_LENGTH_EXCEEDED



def object_fields(value: Any, allowed: set[str], *, what: str, noun: str = "field") -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest(f"{what} must be a JSON object")
    unknown = sorted(set(value) - allowed)
    if unknown:  # the field by its path ("kv_transfer.ttl"): a bare name would read as the client's own field
        path = unknown[0] if what == "request body" else f"{what}.{unknown[0]}"
        raise BadRequest(f"unknown {noun} {path!r}; {what} takes {sorted(allowed)}", param=path)
    return value


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
