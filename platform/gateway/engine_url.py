"""What an engine's URL may be: http(s), a host the resolver takes and an optional port and path. Not Django's
URLValidator, which wants a public domain name (a dot and a TLD, no underscore) and so refused the names engines are
reached by inside a cluster: a compose service `engine_prefill`, a one-label pod or host name (docs/fleet.md)."""

import re
from urllib.parse import urlsplit

from django.core.exceptions import ValidationError

_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?|\[[0-9A-Fa-f:.]+\]")


def engine_url_validate(value: str) -> None:
    message = f"{value!r} is not an engine URL: http(s)://host[:port][/path], the host a name, IPv4 or [IPv6]."
    try:
        parts = urlsplit(value)
        port = parts.port  # a port out of range raises
    except ValueError:
        raise ValidationError(message, code="invalid") from None
    host = parts.netloc.rsplit(":", 1)[0] if port is not None or parts.netloc.endswith(":") else parts.netloc
    if (parts.scheme not in ("http", "https") or "@" in parts.netloc or not _HOST.fullmatch(host)
            or parts.query or parts.fragment or any(c.isspace() for c in value)):  # fmt: skip
        raise ValidationError(message, code="invalid")
