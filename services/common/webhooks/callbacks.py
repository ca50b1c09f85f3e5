"""The server-side request forgery guard of webhook callbacks: which URLs may be called, at which addresses.

A callback URL is checked when the request is submitted and again before every delivery
attempt (DNS answers change; settings change). A URL passes when:

* its scheme is ``http`` or ``https`` and it has no user name or password;
* its host (lower case, IDNA-encoded, without a trailing dot) matches one of
  ``webhook_allowed_hosts`` (``fnmatch`` patterns such as ``*.example.com``); an empty list
  allows no callback at all;
* every address the host resolves to is a public unicast address: loopback, private
  (RFC 1918, ULA), link-local (cloud metadata at 169.254.169.254), shared (100.64/10),
  reserved, documentation, unspecified, multicast, and IPv6 forms embedding such an IPv4
  (mapped, 6to4, Teredo) are refused, unless ``webhook_allow_private`` (local testing:
  loopback, private and link-local are then allowed; unspecified and multicast never).

The delivery then connects to an address it checked (:meth:`CallbackTarget.pinned_url`),
never to a fresh DNS answer, and follows no redirect, so a rebinding DNS server or a 302 to
an internal address cannot steer it elsewhere.
"""

from __future__ import annotations

import asyncio
import fnmatch
import ipaddress
import socket
from dataclasses import dataclass

import httpx

from services.common.errors import OcrstreamError

#: Longest time a host name may take to resolve, s.
RESOLVE_TIMEOUT_S = 5.0

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class CallbackRefused(OcrstreamError):
    """A callback URL the guard refuses.

    Attributes:
        reason: Human-readable, specific reason (safe to show the caller).
        retriable: True when the refusal may pass later (DNS lookup failed); False when it
            never will as configured (scheme, allow-list, private address).
    """

    def __init__(self, reason: str, retriable: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.retriable = retriable


@dataclass(frozen=True)
class CallbackTarget:
    """A checked callback: the parsed URL and the addresses it may be sent to.

    Attributes:
        url: The parsed URL (no user info, no fragment).
        host: The host as matched against the allow-list (lower case, IDNA/ASCII).
        addresses: Checked addresses of ``host``, in resolver order (at least one).
    """

    url: httpx.URL
    host: str
    addresses: tuple[str, ...]

    @property
    def host_header(self) -> str:
        """The ``Host`` header value: the host name plus the port when it is not the scheme's default."""
        default = 443 if self.url.scheme == "https" else 80
        port = self.url.port
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if port in (None, default) else f"{host}:{port}"

    def pinned_url(self, address: str | None = None) -> httpx.URL:
        """The URL with its host replaced by a checked address (the first by default), so the
        connection goes where the guard looked. Send it with :attr:`host_header` and, for
        ``https``, the ``sni_hostname`` request extension set to :attr:`host`."""
        return self.url.copy_with(host=address or self.addresses[0])


def parse_callback_url(url: str, allowed_hosts: list[str]) -> tuple[httpx.URL, str]:
    """The parsed URL and its normalised host, after the checks that need no DNS.

    Args:
        url: The callback URL as submitted.
        allowed_hosts: ``fnmatch`` patterns of host names (case-insensitive).

    Returns:
        ``(url, host)``: the URL without its fragment, and the host as matched.

    Raises:
        CallbackRefused: Not a URL, not http(s), user info present, no host, a port outside
            1-65535, or the host matches no pattern of ``allowed_hosts`` (not retriable).
    """
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise CallbackRefused(f"callback_url is not a valid URL: {exc}") from None
    if parsed.scheme not in ("http", "https"):
        raise CallbackRefused(f"callback_url must be http or https, not {parsed.scheme or 'schemeless'!r}")
    if parsed.userinfo:
        raise CallbackRefused("callback_url must not contain a user name or password")
    try:
        host = parsed.raw_host.decode("ascii").lower().rstrip(".")
    except UnicodeDecodeError:
        raise CallbackRefused("callback_url has an invalid host name") from None
    if not host:
        raise CallbackRefused("callback_url has no host")
    if parsed.port is not None and not 0 < parsed.port < 65536:  # httpx keeps any number (RFC 793: 16 bits)
        raise CallbackRefused(f"callback_url port {parsed.port} is not a TCP port (1-65535)")
    if not allowed_hosts:
        raise CallbackRefused("callbacks are disabled: no host is allowed (webhook_allowed_hosts is empty)")
    if not any(fnmatch.fnmatchcase(host, p.lower().rstrip(".")) for p in allowed_hosts):
        raise CallbackRefused(f"callback host {host!r} is not on the allow-list")
    return parsed.copy_with(fragment=None), host


def address_refusal(ip: IPAddress, allow_private: bool) -> str | None:
    """Why ``ip`` may not be called (e.g. ``"link-local"``), or None when it may.

    IPv6 addresses that embed an IPv4 address (mapped, 6to4, Teredo) are judged by it too.
    """
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_multicast:
        return "multicast"
    if isinstance(ip, ipaddress.IPv6Address):
        for inner in (ip.ipv4_mapped, ip.sixtofour, ip.teredo[1] if ip.teredo else None):
            if inner is not None:
                why = address_refusal(inner, allow_private)
                if why:
                    return why
    if allow_private:
        return None
    for name in ("loopback", "link_local", "private", "reserved", "site_local"):
        if getattr(ip, f"is_{name}", False):
            return name.replace("_", "-")
    if not ip.is_global:
        return "not globally routable"
    return None


async def resolve(host: str, port: int) -> tuple[str, ...]:
    """The addresses of ``host`` (an IP literal resolves to itself), deduplicated, in resolver order.

    Raises:
        CallbackRefused: The lookup failed or timed out (retriable).
    """
    try:
        return (str(ipaddress.ip_address(host)),)
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP), RESOLVE_TIMEOUT_S
        )
    except asyncio.TimeoutError:
        raise CallbackRefused(f"callback host {host!r} did not resolve within {RESOLVE_TIMEOUT_S:g}s",
                              retriable=True) from None
    except OSError as exc:
        raise CallbackRefused(f"callback host {host!r} does not resolve: {exc.strerror or exc}",
                              retriable=True) from None
    addrs = tuple(dict.fromkeys(info[4][0].split("%")[0] for info in infos))
    if not addrs:
        raise CallbackRefused(f"callback host {host!r} has no address", retriable=True)
    return addrs


async def check_callback(url: str, allowed_hosts: list[str], allow_private: bool) -> CallbackTarget:
    """Parse, match against the allow-list, resolve, and check every address of a callback URL.

    Args:
        url: The callback URL.
        allowed_hosts: ``fnmatch`` patterns of allowed host names.
        allow_private: Allow loopback/private/link-local addresses (local testing only).

    Returns:
        The checked target; send to :meth:`CallbackTarget.pinned_url`.

    Raises:
        CallbackRefused: With the specific reason (see :func:`parse_callback_url`,
            :func:`resolve`); an address refused names the address and its range.
    """
    parsed, host = parse_callback_url(url, allowed_hosts)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    addrs = await resolve(host, port)
    for a in addrs:
        why = address_refusal(ipaddress.ip_address(a), allow_private)
        if why:
            where = f"callback address {a} is" if host == a else f"callback host {host!r} resolves to {a},"
            raise CallbackRefused(f"{where} a {why} address; only public addresses may be called")
    return CallbackTarget(url=parsed, host=host, addresses=addrs)
