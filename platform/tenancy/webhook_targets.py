"""Where a tenant's webhooks may point: public addresses only. A target that is, or resolves to, a loopback,
private, link-local (cloud metadata), shared, multicast, reserved or unspecified address is refused, when the URL is
saved and again right before each delivery (after DNS resolution, since a name can be re-pointed later).
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
        return [ipaddress.ip_address(host).compressed]
    except ValueError:
        pass
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)})
    except (socket.gaierror, UnicodeError):
        return []


def webhook_target_problem(url: str, *, must_resolve: bool) -> str | None:
    """Why `url` may not receive webhooks, or None when it may."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "A webhook URL must be an http(s) URL with a host name."
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return "The webhook URL's port is not valid."
    addresses = _addresses(parts.hostname, port)
    if not addresses:
        return f"The webhook host {parts.hostname} does not resolve." if must_resolve else None
    if any(_refused_address(address) for address in addresses):
        return "Webhooks may only go to public addresses (not loopback, private, link-local or reserved ones)."
    return None


def validate_webhook_url(url: str) -> None:
    """Save time (model validator): refuses non-public targets; a name that does not resolve yet is allowed."""
    if url:
        problem = webhook_target_problem(url, must_resolve=False)
        if problem:
            raise ValidationError(problem, code="webhook_target")


def webhook_target_check(url: str) -> None:
    """Delivery time: refuses unless every address the host resolves to now is public."""
    problem = webhook_target_problem(url, must_resolve=True)
    if problem:
        raise WebhookTargetRefused(problem)
