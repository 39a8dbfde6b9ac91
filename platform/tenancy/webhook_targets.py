"""Where a tenant's webhooks may point: public addresses only. A target that is, or resolves to, a loopback,
private, link-local (cloud metadata), shared, multicast, reserved or unspecified address is refused, when the URL is
saved (addresses and local names) and again right before each delivery (after DNS resolution, since a name can be
re-pointed later). What remains: a name re-pointed between this check and the connection (seconds).
Networks in QUILT_WEBHOOK_ALLOWED_NETWORKS are let through (a local receiver in development or tests)."""

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


def webhook_target_problem(url: str, *, resolve: bool) -> str | None:
    """Why `url` may not receive webhooks, or None when it may. Without `resolve`, only what the URL itself says
    (an address, or a name that is local by definition) is judged: saving never waits on DNS."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "A webhook URL must be an http(s) URL with a host name."
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return "The webhook URL's port is not valid."
    host = parts.hostname.rstrip(".").lower()
    if host == "localhost" or host.endswith(_LOCAL_NAMES):
        return INSIDE
    try:
        addresses = [ipaddress.ip_address(host.split("%", 1)[0]).compressed]
    except ValueError:
        if not resolve:
            return None
        addresses = _addresses(host, port)
    if not addresses:
        return f"The webhook host {host} does not resolve."
    if any(_refused_address(address) for address in addresses):
        return INSIDE
    return None


def validate_webhook_url(url: str) -> None:
    """Save time (model validator): refuses addresses and names that are not public."""
    if url:
        problem = webhook_target_problem(url, resolve=False)
        if problem:
            raise ValidationError(problem, code="webhook_target")


def webhook_target_check(url: str) -> None:
    """Delivery time: refuses unless every address the host resolves to now is public."""
    problem = webhook_target_problem(url, resolve=True)
    if problem:
        raise WebhookTargetRefused(problem)
