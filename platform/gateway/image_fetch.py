"""Fetching an image a chat request names by http(s) URL, where the deployment allows it (settings.QUILT_IMAGE_FETCH),
without letting the URL reach what the gateway can reach and the caller cannot (server-side request forgery, as in
vLLM's CVE-2025-6242): the host must be on the operator's allowlist; the name is resolved once and the connection
made to that address (pinned: the name can't resolve elsewhere in between), which must be public; each redirect is
a new URL checked the same way; the body is cut off past the byte limit and the whole fetch past its timeout."""

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import httpx

Resolver = Callable[[str, int], Awaitable[list[str]]]  # (host, port) -> its addresses


class FetchRefused(Exception):
    """The URL is not fetched, or its fetch failed; the message says why, for the caller."""


@dataclass(frozen=True)
class FetchPolicy:
    domains: Sequence[str]  # "images.example" exactly; ".example.com" any host under example.com
    allowed_networks: Sequence[str]  # CIDRs trusted despite being private (an internal image store)
    max_bytes: int
    timeout_s: float
    max_redirects: int

    def host_allowed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host.endswith(entry.lower()) if entry.startswith(".") else host == entry.lower().rstrip(".")
                   for entry in self.domains)  # fmt: skip

    def address_allowed(self, address: str) -> bool:
        ip = ipaddress.ip_address(address)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if any(ip in ipaddress.ip_network(network, strict=False) for network in self.allowed_networks):
            return True
        return ip.is_global and not ip.is_multicast  # private, loopback, link-local, reserved, shared: refused


async def system_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


async def fetch_image(url: str, policy: FetchPolicy, *, resolve: Resolver = system_resolver) -> bytes:
    """The body of `url` (a 200 after at most policy.max_redirects redirects); FetchRefused otherwise."""
    try:
        async with asyncio.timeout(policy.timeout_s):
            async with httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=policy.timeout_s) as client:
                for _ in range(policy.max_redirects + 1):
                    target = await _pinned(url, policy, resolve)
                    async with client.stream("GET", target.url, headers={"Host": target.host_header},
                                             extensions={"sni_hostname": target.host}) as response:  # fmt: skip
                        if response.is_redirect:
                            url = str(httpx.URL(url).join(response.headers["location"]))
                            continue
                        if response.status_code != 200:
                            raise FetchRefused(f"fetching the image answered HTTP {response.status_code}")
                        return await _capped(response, policy.max_bytes)
                raise FetchRefused(f"fetching the image took more than {policy.max_redirects} redirects")
    except TimeoutError:
        raise FetchRefused(f"fetching the image took longer than {policy.timeout_s:g} s") from None
    except httpx.HTTPError as error:
        raise FetchRefused(f"fetching the image failed: {error.__class__.__name__}") from None


@dataclass(frozen=True)
class _Target:
    url: httpx.URL  # the original URL with its host replaced by the pinned address
    host: str
    host_header: str


async def _pinned(url: str, policy: FetchPolicy, resolve: Resolver) -> _Target:
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        raise FetchRefused("the image URL is not a valid URL") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise FetchRefused("only http and https image URLs are fetched")
    if parsed.userinfo:
        raise FetchRefused("image URLs with credentials are not fetched")
    host = parsed.host
    if not policy.host_allowed(host):
        raise FetchRefused(f"the host {host!r} is not on this server's image allowlist")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        addresses = await resolve(host, port)
    except OSError:
        raise FetchRefused(f"the host {host!r} does not resolve") from None
    if not addresses:
        raise FetchRefused(f"the host {host!r} does not resolve")
    refused = [address for address in addresses if not policy.address_allowed(address)]
    if refused:  # every address the name has must be public: a pick among them must not be the caller's to steer
        raise FetchRefused(f"the host {host!r} resolves to {refused[0]}, an address that is not public")
    address = addresses[0]
    host_header = host if parsed.port is None else f"{host}:{parsed.port}"
    return _Target(url=parsed.copy_with(host=address), host=host, host_header=host_header)


async def _capped(response: httpx.Response, max_bytes: int) -> bytes:
    length = response.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise FetchRefused(f"the image is larger than {max_bytes} bytes")
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > max_bytes:
            raise FetchRefused(f"the image is larger than {max_bytes} bytes")
    return bytes(body)
