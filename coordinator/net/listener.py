"""The coordinator's listening socket: every TCP connection counted from accept to close.

Counting in the websocket layer comes too late: with TLS, asyncio completes the TLS handshake
(holding a 256 KiB buffer per socket) before any protocol code runs, so silent sockets that
never finish it would not count against any cap. This socket counts a connection the moment it
is accepted, refuses one past the caps before TLS or websockets see it (closed at once, no
reply), and uncounts it when its transport closes the socket.

``ConnectionCounter`` holds the numbers; the server marks a connection authenticated (by its
file descriptor) once it has passed its hello or token.
"""

from __future__ import annotations

import socket
from typing import Any

from cleave.coordinator.engine.limits import HEADROOM, Limits


class ConnectionCounter:
    """Open connections and those not yet authenticated, keyed by file descriptor."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.open = 0
        self.pending: set[int] = set()
        self.refused = 0

    def admit(self, fd: int) -> bool:
        lim = self.limits
        if self.open >= lim.max_connections + HEADROOM or len(self.pending) >= lim.unauthenticated + HEADROOM:
            self.refused += 1
            return False
        self.open += 1
        self.pending.add(fd)
        return True

    def over_cap(self) -> bool:
        """Past a cap, but within the headroom that still gets a close code."""
        lim = self.limits
        return self.open > lim.max_connections or len(self.pending) > lim.unauthenticated

    def authenticated(self, fd: int) -> None:
        self.pending.discard(fd)

    def closed(self, fd: int) -> None:
        self.open -= 1
        self.pending.discard(fd)


class _Tracked(socket.socket):
    """An accepted connection that tells its counter when it is closed."""

    _counter: ConnectionCounter | None = None
    _counted_fd = -1

    def close(self) -> None:
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.closed(self._counted_fd)
        super().close()


class _Listener(socket.socket):
    counter: ConnectionCounter

    def accept(self) -> tuple[socket.socket, Any]:
        fd, addr = self._accept()  # type: ignore[attr-defined]
        conn = _Tracked(self.family, self.type, self.proto, fileno=fd)
        if socket.getdefaulttimeout() is None and self.gettimeout():
            conn.setblocking(True)
        if not self.counter.admit(fd):
            conn.close()
            raise ConnectionAbortedError("past the connection caps")  # asyncio moves on to the next
        conn._counter, conn._counted_fd = self.counter, fd
        return conn, addr


def bind(host: str, port: int, counter: ConnectionCounter) -> socket.socket:
    """A listening socket on ``host``:``port`` whose accepted connections ``counter`` counts.

    A name that resolves to several addresses is bound on one, IPv4 first (so ``localhost``
    serves 127.0.0.1); ``::`` accepts IPv4 too where the system allows it."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = sorted(infos, key=lambda info: info[0] != socket.AF_INET)[0]
    dual = family == socket.AF_INET6 and host.strip("[]") == "::" and socket.has_dualstack_ipv6()
    plain = socket.create_server(address, family=family, dualstack_ipv6=dual)
    listener = _Listener(family, socket.SOCK_STREAM, fileno=plain.detach())
    listener.counter = counter
    return listener
