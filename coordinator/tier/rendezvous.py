"""The rendezvous store, and what keeps a stranger who reaches its port from forging what the
ranks read there.

torch's TCPStore has no authentication: any client that reaches its port may read, list, write
and delete every key. So:

* Rank 0 listens only on the address ``--rendezvous`` names (``listen``: a socket bound here and
  handed to the store), not on every interface as torch's store binds by itself.
* Every key of the tier lives under ``cleave-tier/<namespace>/``, the namespace an HMAC under the
  tier's secret (``auth.tier_namespace``): a stranger cannot name one without listing the store,
  and an old client's or another tier's keys never mix with this one's.
* Every value a rank reads back is sealed and bounded. gloo's addresses go through
  ``SealedStore``, under a key made from the secret and rank 0's fresh nonce for this run (so an
  address recorded in an earlier run does not pass, unless that run's nonce is replayed too: the
  nonce is sealed under a key the same in every run, and a rank that takes an old one meets no
  one who can prove the secret, so the meeting fails); the tier's own heartbeats, arrivals and
  notices are sealed under the meeting's key (``group.py``). A value that fails is ignored, and
  one line says why.
* A key outside the namespace is a rank given another secret only when it is shaped as a
  rank's arrival at the meeting (``ARRIVAL``) for a place this tier's namespace lacks
  (``foreign``); the rest is a stranger's junk, logged once and waited past.

What a stranger at the port can still do: list the keys (torch lists them to any client), delete
or overwrite them, fill the store with junk, write a key shaped as an arrival, or replay an
earlier run's nonce. That stops the tier (the ranks time out or name
a rank lost) and costs rank 0 memory; it never makes a rank believe a forged value.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from cleave.wire import auth
from cleave.wire.errors import ConfigError

log = logging.getLogger("cleave.tier")

ROOT = "cleave-tier/"  # every tier's keys are under ROOT + namespace + "/"
RUN = "run"  # rank 0's nonce for this run of the tier (sealed under the key without one)
MAC_BYTES = 32
MAX_GLOO_VALUE = 64 * 1024  # gloo's address of a rank: about 170 bytes
FORGED_POLL = 0.1  # seconds between looks at a key whose value failed its seal
LOOKOUT = 0.5  # seconds between a waiting rank's looks for another secret's keys
HERE = "here/{rank}"  # a rank (not 0) at the meeting, before rank 0's nonce (sealed: an empty value)
# A rank's arrival at the meeting under some secret's namespace (and torchrun's attempt): rank 0's
# nonce, or another rank's mark. Only such a key, for a place this tier's own namespace lacks, is
# taken for a rank given another secret; any other key outside the namespace is a stranger's junk.
# (torch's PrefixStore puts a "/" between its prefix and a key.)
ARRIVAL = re.compile(re.escape(ROOT) + r"[0-9a-f]{32}/(?:attempt-[0-9]{1,9}/)?/(?:" + RUN + r"|here/([0-9]{1,9}))")
WAIT_POLL = 0.05  # seconds between a waiting rank's looks for a key
MAX_DOUBTS = 1024  # distinct keys logged as not believed (then silence: a flood logs nothing more)


def listen(host: str, port: int, world: int = 1) -> int:
    """A socket listening on ``host``'s address only, as a descriptor for
    ``TCPStore(master_listen_fd=...)``, which then owns it (libuv's backend takes it as is).
    A name that resolves to a loopback address (Debian and Ubuntu map the machine's own name to
    127.0.1.1) is said in one line when other ranks are to come: only ranks on this machine can
    reach it (which a tier on one machine may mean; an address typed as such is taken as meant)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"--rendezvous names {host!r}, which does not resolve here: {exc}") from None
    if world > 1 and ipaddress.ip_address(addr[0]).is_loopback and not _literal(host):
        log.warning(
            "tier: --rendezvous %s resolves to %s, a loopback address: rank 0 listens there only, so ranks on "
            "other machines cannot reach it (name an address they reach, such as this machine's LAN address)",
            host,
            addr[0],
        )
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch does: a restarted rank 0 rebinds at once
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        why = f"rank 0 cannot listen at {host}:{port}, the address --rendezvous names ({exc.strerror or exc})"
        raise ConfigError(f"{why}: it must be one of this machine's addresses, and the port free") from None
    return sock.detach()


def _literal(host: str) -> bool:
    """Whether ``host`` is an IP address as typed (not a name)."""
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def namespace(secret: bytes, attempt: str | None = None) -> str:
    """The prefix of every key of the tier (``attempt``: torchrun's restart count, whose agent
    keeps one store across restarts)."""
    return ROOT + auth.tier_namespace(secret) + "/" + (f"attempt-{attempt}/" if attempt is not None else "")


def seal(key: bytes, name: str, value: bytes) -> bytes:
    return auth.tier_value_mac(key, name, value) + value


def unseal(key: bytes, name: str, data: bytes, limit: int) -> tuple[bytes | None, str]:
    """``(value, "")`` for a value sealed under ``key`` for ``name``, else ``(None, why not)``."""
    if len(data) > MAC_BYTES + limit:
        return None, f"{len(data)} bytes, over {MAC_BYTES + limit}"
    mac, value = data[:MAC_BYTES], data[MAC_BYTES:]
    if not auth.tier_value_ok(key, name, value, mac):
        return None, "it fails the tier's seal"
    return value, ""


class Doubts:
    """One logged line per key whose value was not believed (until a believed one comes)."""

    def __init__(self) -> None:
        self._keys: set[str] = set()

    def note(self, name: str, why: str) -> None:
        if name in self._keys or len(self._keys) >= MAX_DOUBTS:
            return
        self._keys.add(name)
        log.warning("tier: %s in the rendezvous store is not believed (%s): a stranger at the port?", name, why)

    def clear(self, name: str) -> None:
        self._keys.discard(name)


class SealedStore(dist.Store):
    """The store gloo meets through: each value it sets is sealed under ``key``, and it reads back
    only values sealed so. A forged value is looked past (its rank may yet write the real one)
    until ``timeout``, then refused: the meeting fails, in one line, rather than gloo connecting to
    an address a stranger wrote. (Keep a reference to it: the C++ side calls back into this
    object.)"""

    def __init__(
        self,
        key: bytes,
        inner: dist.Store,
        timeout: timedelta,
        *,
        lookout: Callable[[], None] | None = None,
        every: float = LOOKOUT,
        limit: int = MAX_GLOO_VALUE,
    ) -> None:
        """``lookout``: called every ``every`` seconds while a wait lasts (it may raise: say, on
        finding a rank that holds another secret, rather than wait out the timeout)."""
        super().__init__()
        self._key, self._inner, self._wait, self._limit = key, inner, timeout, limit
        self._lookout, self._every = lookout, every
        self._doubts = Doubts()

    def set(self, name: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(name, seal(self._key, name, data))

    def get(self, name: str) -> bytes:
        deadline = time.monotonic() + self._wait.total_seconds()
        self.wait([name])
        while True:
            value, why = unseal(self._key, name, self._inner.get(name), self._limit)
            if value is not None:
                self._doubts.clear(name)
                return value
            self._doubts.note(name, why)
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"{name} in the rendezvous store is not believed ({why})")
            time.sleep(FORGED_POLL)

    def multi_get(self, names: list[str]) -> list[bytes]:
        return [self.get(name) for name in names]

    def multi_set(self, names: list[str], values: list[bytes]) -> None:
        for name, value in zip(names, values, strict=True):
            self.set(name, value)

    def check(self, names: list[str]) -> bool:
        return self._inner.check(names)

    def wait(self, names: list[str], timeout: timedelta | None = None) -> None:
        # Polled, not the store's wait in slices: each slice that ran out would log a warning.
        limit = (self._wait if timeout is None else timeout).total_seconds()
        start = looked = time.monotonic()
        while not self._inner.check(names):
            now = time.monotonic()
            if now - start >= limit:
                raise dist.DistStoreError(f"wait timeout after {limit:g} s, keys: {', '.join(names)}")
            if self._lookout is not None and now - looked >= self._every:
                looked = now
                self._lookout()
            time.sleep(WAIT_POLL)

    def delete_key(self, name: str) -> bool:
        return self._inner.delete_key(name)

    def num_keys(self) -> int:
        return self._inner.num_keys()


def foreign(store: dist.Store, secret: bytes, space: str, world: int) -> tuple[list[str], list[str]]:
    """The tier keys in the store outside this secret's namespace: ``(arrivals, junk)``.
    ``arrivals``: keys shaped as a rank's arrival at the meeting (rank 0's nonce, another rank's
    mark) for a place of this world that this tier's own namespace (``space``) lacks: a rank given
    another secret. ``junk``: the rest (a stranger's; they stop nothing). Never raises."""
    mine = namespace(secret)
    try:
        keys = [k for k in store.list_keys() if k.startswith(ROOT)]
    except Exception:  # (a store gone, or a torch without list_keys)
        return [], []
    ours = {k for k in keys if k.startswith(mine)}
    arrivals, junk = [], []
    for key in keys:
        if key in ours:
            continue
        shape = ARRIVAL.fullmatch(key)
        place = None if shape is None else int(shape.group(1) or 0)
        if place is not None and place < world and f"{space}/{HERE.format(rank=place) if place else RUN}" not in ours:
            arrivals.append(key)
        else:
            junk.append(key)
    return arrivals, junk
