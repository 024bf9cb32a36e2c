"""How a client reaches a coordinator: which URLs it accepts, and TLS that verifies.

``wss://`` URLs are verified against the system's certificate store, or against ``cafile``
(a private CA, a self-signed coordinator). A plain ``ws://`` URL is accepted for loopback
addresses only, unless the user passes ``--insecure``: over a network, ws:// exposes the join
token, the operator token and every block to anyone on the path.
"""

from __future__ import annotations

import ssl

from cleave.wire.addresses import is_loopback, url_host
from cleave.wire.errors import ConfigError


class URLRefused(ConfigError):
    """A coordinator URL this client will not use as given."""


def check_url(url: str, *, insecure: bool = False) -> None:
    if not url.startswith(("ws://", "wss://")):
        raise URLRefused(f"coordinator URL must start with ws:// or wss://, got {url!r}")
    host = url_host(url)
    if not host:
        raise URLRefused(f"coordinator URL has no host: {url!r}")
    if url.startswith("ws://") and not insecure and not is_loopback(host):
        raise URLRefused(
            f"refusing unencrypted ws:// to {host}: tokens, credentials and blocks would cross the network "
            "in clear. Use wss:// (the coordinator's --certfile/--keyfile), or pass --insecure on a network you trust"
        )


def client_tls(url: str, cafile: str | None = None) -> ssl.SSLContext | None:
    """The TLS context for ``url`` (None for ws://). Certificates and host names are checked."""
    if not url.startswith("wss://"):
        return None
    try:
        return ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as exc:
        raise URLRefused(f"cannot load --cafile {cafile}: {exc}") from None
