"""Address rules both sides apply: which hosts only this machine can reach, and a URL's host."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach. Names are not resolved, except
    "localhost"; an unencrypted ws:// URL to anything else needs the peer's explicit consent."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_host(url: str) -> str:
    """The host of a ws:// or wss:// URL ("" if it has none)."""
    try:
        return urlsplit(url).hostname or ""
    except ValueError:
        return ""


# Networks a device's own LAN or its provider's may hold (RFC 1918, carrier-grade NAT, IPv4 and
# IPv6 link-local, unique local).
_PRIVATE = tuple(
    ipaddress.ip_network(n)
    for n in (
        "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16", "fc00::/7", "fe80::/10"
    )
)  # fmt: skip


def odd_ipv4(host: str) -> bool:
    """True for a host that is no standard address yet that the resolver reads as an IPv4 one
    (``127.1``, ``2130706433``, ``0x7f000001``, ``0177.0.0.1``, ``0``): a way round address rules."""
    if _ip(host) is not None:
        return False
    try:
        socket.inet_aton(host)
    except OSError:
        return False
    return True


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_private(host: str) -> bool:
    """True for a private or link-local IP address (RFC 1918, 169.254/16, fc00::/7, fe80::/10).
    Names are not resolved."""
    ip = _ip(host)
    return ip is not None and any(ip in net for net in _PRIVATE if net.version == ip.version)


def relay_host_refused(relay_url: str, coordinator_url: str) -> str:
    """Why a device refuses the relay its coordinator names ("" if it takes it): a loopback or
    unspecified address (its own machine) unless the coordinator's is loopback too, and a private
    or link-local one (its own LAN) unless the coordinator's is loopback or private too. A relay
    names its own URL: a public coordinator must not make its devices knock on their own machine or
    LAN. Host names pass (DNS may still point anywhere; docs/security.md "Relays")."""
    host, home = url_host(relay_url), url_host(coordinator_url)
    if odd_ipv4(host):
        return f"refusing relay {relay_url}: {host!r} is not a standard address"
    ip = _ip(host)
    own = is_loopback(host) or (ip is not None and (ip.is_loopback or ip.is_unspecified))
    if own and not is_loopback(home):
        return f"refusing relay {relay_url}: it is this machine, and the coordinator is not"
    if is_private(host) and not (is_loopback(home) or is_private(home)):
        return f"refusing relay {relay_url}: it is on a private network, and the coordinator is not"
    return ""
