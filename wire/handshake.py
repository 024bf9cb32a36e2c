"""How much of a websocket upgrade request a Cleave server reads before it sees the peer.

The websocket library reads a whole upgrade request first; its defaults (128 header lines of
8 KiB) let an unauthenticated connection make a server hold 1 MiB. A client or a reverse proxy
sends about ten short lines. Every server Cleave builds (the coordinator's, a relay's) calls
``bound_handshakes`` where it is built, whatever was imported before (the library reads these
per request), so the command line and the Python API get the same limits (docs/security.md).
"""

from __future__ import annotations

from websockets import http11

HANDSHAKE_HEADERS = 64  # header lines of an upgrade request, at most
HANDSHAKE_LINE = 4096  # bytes of one line, at most


def bound_handshakes() -> None:
    """Hold the library to ``HANDSHAKE_HEADERS`` lines of ``HANDSHAKE_LINE`` bytes (process-wide;
    lower limits an operator set through its ``WEBSOCKETS_MAX_*`` variables stay)."""
    http11.MAX_NUM_HEADERS = min(http11.MAX_NUM_HEADERS, HANDSHAKE_HEADERS)
    http11.MAX_LINE_LENGTH = min(http11.MAX_LINE_LENGTH, HANDSHAKE_LINE)


def handshake_bytes() -> int:
    """The largest websocket upgrade request a Cleave server reads."""
    return HANDSHAKE_HEADERS * HANDSHAKE_LINE
