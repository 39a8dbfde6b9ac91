"""Where a tenant's webhooks may point: public addresses only. A target that is, or resolves to, a loopback,
private, link-local (cloud metadata), shared, multicast, reserved or unspecified address is refused, when the URL is
saved (addresses and local names) and again right before each delivery (after DNS resolution, since a name can be
re-pointed later). The delivery then connects to the address that was checked, not to whatever the name resolves to
a moment later (DNS rebinding): the host goes in the Host header and, for https, in TLS's server name, so the
certificate is still checked against the name. Networks in QUILT_WEBHOOK_ALLOWED_NETWORKS are let through (a local
receiver in development or tests)."""

import ipaddress
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


def webhook_target_problem(url: str, *, resolve: bool) -> str | None:
    """Why `url` may not receive webhooks, or None when it may (see _judged)."""
    return _judged(url, resolve=resolve)[0]


def validate_webhook_url(url: str) -> None:
    """Save time (model validator): refuses addresses and names that are not public."""
    if url:
        problem = webhook_target_problem(url, resolve=False)
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
