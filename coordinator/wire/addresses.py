"""Address rules both sides apply: which hosts only this machine can reach, and a URL's host."""

from __future__ import annotations

import ipaddress
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
