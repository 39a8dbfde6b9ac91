"""Where a tenant's webhooks may point: public addresses only, named by a public host name. The one rule for a
saved URL (WEBHOOK_URL, the API's schema states it; the console and the API both save through the model's validator):
http(s), a lower-case host name that is not local by definition (localhost, .internal ...), never an address literal.
Right before each delivery the name is resolved, and a target that resolves to a loopback, private, link-local
(cloud metadata), shared, multicast, reserved or unspecified address is refused (a name can be re-pointed later). The delivery then connects to the address that was checked, not to whatever the name resolves to
a moment later (DNS rebinding): the host goes in the Host header and, for https, in TLS's server name, so the
certificate is still checked against the name. Networks in QUILT_WEBHOOK_ALLOWED_NETWORKS are let through at
delivery (a local receiver in development or tests, under a name that resolves to it)."""

import ipaddress
import re
import socket
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.core.exceptions import ValidationError


class WebhookTargetRefused(httpx.HTTPError):
    """Raised at delivery: billing records it like any failed delivery."""


def _refused_address(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if any(ip in ipaddress.ip_network(network) for network in settings.QUILT_WEBHOOK_ALLOWED_NETWORKS):
        return False
    return not ip.is_global or ip.is_multicast


def _addresses(host: str, port: int) -> list[str]:
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)})
    except (socket.gaierror, UnicodeError):
        return []


INSIDE = "Webhooks may only go to public addresses (not loopback, private, link-local or reserved ones)."
_LOCAL_NAMES = ("localhost", ".localhost", ".local", ".internal", ".localdomain")


def _judged(url: str, *, resolve: bool) -> tuple[str | None, list[str]]:
    """(why `url` may not receive webhooks or None, the addresses judged). Without `resolve`, only what the URL
    itself says (an address, or a name that is local by definition) is judged: saving never waits on DNS."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "A webhook URL must be an http(s) URL with a host name.", []
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return "The webhook URL's port is not valid.", []
    host = parts.hostname.rstrip(".").lower()
    if host == "localhost" or host.endswith(_LOCAL_NAMES):
        return INSIDE, []
    try:
        addresses = [ipaddress.ip_address(host.split("%", 1)[0]).compressed]
    except ValueError:
        if not resolve:
            return None, []
        addresses = _addresses(host, port)
    if not addresses:
        return f"The webhook host {host} does not resolve.", []
    if any(_refused_address(address) for address in addresses):
        return INSIDE, addresses
    return None, addresses


# An http(s) URL on a public host name: a subset of what Django's URLValidator takes (the model's field checks that
# too), in URI characters only. No address literal and no local name: the addresses a name resolves to are judged
# at delivery.
_PCHAR = r"(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})"
WEBHOOK_URL = (
    r"^https?://(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)+"
    r"(?!(?:local|internal|localdomain|localhost)(?:[:/?#]|$))[a-z]{2,63}"
    r"(?::(?:[0-9]{1,4}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5]))?"
    rf"(?:/(?:{_PCHAR}|/)*)?(?:\?(?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?$"
)
_WEBHOOK_URL = re.compile(WEBHOOK_URL)
NOT_A_NAME = "A webhook URL names its host; an IP address is not taken (the name's addresses are checked at delivery)."
MALFORMED = "A webhook URL is http(s) on a public host name, lower case."


def _save_problem(url: str) -> str | None:
    if _WEBHOOK_URL.fullmatch(url):
        return None
    try:
        host = (urlsplit(url).hostname or "").rstrip(".")
    except ValueError:
        return MALFORMED
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return _judged(url, resolve=False)[0] or MALFORMED
    return INSIDE if _refused_address(host) else NOT_A_NAME


def validate_webhook_url(url: str) -> None:
    """The rule for a saved webhook URL (model validator, so every service that saves a tenant applies it): WEBHOOK_URL,
    with a message that says which part of it the URL breaks."""
    if url:
        problem = _save_problem(url)
        if problem:
            raise ValidationError(problem, code="webhook_target")


def webhook_post(url: str, *, content: bytes, headers: dict[str, str], timeout: float) -> httpx.Response:
    """Delivery: POSTs to `url` only if every address its host resolves to now is public (else WebhookTargetRefused),
    connecting to the address that was checked. Redirects are not followed."""
    problem, addresses = _judged(url, resolve=True)
    if problem:
        raise WebhookTargetRefused(problem)
    parts = urlsplit(url)
    address = addresses[0]
    literal = f"[{address}]" if ":" in address else address
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = (f"{userinfo}@" if userinfo else "") + (literal if parts.port is None else f"{literal}:{parts.port}")
    pinned = parts._replace(netloc=netloc).geturl()
    host_header = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
    extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    with httpx.Client(timeout=timeout) as client:
        request = client.build_request("POST", pinned, content=content, headers={**headers, "Host": host_header},
                                       extensions=extensions)  # fmt: skip
        return client.send(request)
