"""Every limit the coordinator enforces, in one place, and the worst-case memory they imply.

Nothing here does I/O. ``TokenBucket`` takes ``now`` (a monotonic clock), so tests and the
simulator move time by hand. ``memory_bound`` is the formula docs/security.md states; a test
holds a real coordinator to it under attack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cleave.wire.errors import ConfigError
from cleave.wire.handshake import handshake_bytes


@dataclass
class TokenBucket:
    """``rate`` events per second on average, ``burst`` at once. ``take`` is O(1)."""

    rate: float
    burst: float
    _level: float = field(default=-1.0, repr=False)
    _at: float = field(default=0.0, repr=False)

    def take(self, now: float, amount: float = 1.0) -> bool:
        """Take ``amount`` tokens at ``now``; False (nothing taken) when there are too few."""
        if self._level < 0:  # full on first use
            self._level, self._at = self.burst, now
        self._level = min(self.burst, self._level + max(0.0, now - self._at) * self.rate)
        self._at = now
        if amount > self._level:
            return False
        self._level -= amount
        return True


def cooloff(first: float, most: float, marks: int) -> float:
    """A cool-off that doubles with each mark: ``first`` after one, at most ``most``. The
    exponent is capped before it is taken (``2 ** 1024`` does not fit in a float), so any
    count of marks gives ``most``."""
    doublings = min(max(0, marks - 1), 64)
    return min(most, first * 2.0**doublings)


@dataclass(frozen=True)
class Rate:
    """A rate limit: ``per_second`` on average, ``burst`` at once."""

    per_second: float
    burst: float

    def bucket(self) -> TokenBucket:
        """A fresh, full bucket of this rate."""
        return TokenBucket(self.per_second, self.burst)


@dataclass(frozen=True)
class TrustPolicy:
    """How an identity earns tiles, and loses them.

    New identities are on probation: one tile at a time, and the first rejected result bans
    them. After ``probation_tiles`` verified tiles (over every job) a device earns one more slot
    for every ``grow_every`` verified results, up to ``max_slots`` (and never more than it asked
    for). A lease that passes its deadline sends it back to one slot; ``cut_after`` leases taken
    back in a row (no verified result between) cut it, and it may not reconnect for a cool-off
    that doubles with every cut; releases past ``give_backs`` in a row count as leases taken
    back. A device on probation that lets ``cut_unanswered`` leases in a
    row go to other copies without ever answering is cut the same way (a staller loses its tiles
    to speculation before their deadlines pass; this finds it anyway). ``ban_rejects`` rejected
    results among its last ``window`` ban it.
    """

    probation_tiles: int = 20
    first_slots: int = 1  # slots off probation before any growth (verified results on probation count)
    window: int = 50
    ban_rejects: int = 2
    max_slots: int = 8
    grow_every: int = 4
    cut_after: int = 3
    cut_unanswered: int = 8  # on probation: leases lost to other copies in a row, with no result of its own
    cut_unanswered_trusted: int = 32  # ... and off probation
    # Releases in a row with no verified result between that cost nothing; each past them counts
    # as a lease taken back (cut_after of those cut it). An honest device gives back a lost
    # block's tile, then returns work. Pauses and departures have rate limits of their own
    # (Limits.pauses, reconnects) and spend none of it.
    give_backs: int = 8
    prefetch_seconds: float = 4.0  # a device holds at most the tiles it verifies in this long
    reconnects: Rate = Rate(0.1, 6.0)  # connections of one identity: 6 at once, then one per 10 s
    cooloff: float = 10.0
    cooloff_max: float = 600.0
    standings: int = 65536  # identities whose record this process remembers (least recent forgotten)

    def __post_init__(self) -> None:
        from cleave.wire.messages import MAX_SLOTS  # here: this module loads before torch (cleave_cli)

        checks = [
            (self.window >= 1, "window", "must be at least 1"),
            (1 <= self.ban_rejects <= self.window, "ban_rejects", f"must be between 1 and window ({self.window})"),
            (1 <= self.max_slots <= MAX_SLOTS, "max_slots", f"must be between 1 and {MAX_SLOTS}"),
            (
                1 <= self.first_slots <= self.max_slots,
                "first_slots",
                f"must be between 1 and max_slots ({self.max_slots})",
            ),
            (self.grow_every >= 1, "grow_every", "must be at least 1"),
            (self.cut_after >= 1, "cut_after", "must be at least 1"),
            (self.give_backs >= 0, "give_backs", "must be at least 0"),
            (self.cut_unanswered >= 1, "cut_unanswered", "must be at least 1"),
            (
                self.cut_unanswered <= self.cut_unanswered_trusted,
                "cut_unanswered_trusted",
                f"must be at least cut_unanswered ({self.cut_unanswered})",
            ),
            (self.cooloff > 0, "cooloff", "must be above 0 s"),
            (self.cooloff <= self.cooloff_max, "cooloff_max", f"must be at least cooloff ({self.cooloff:g} s)"),
            (self.standings >= 1, "standings", "must be at least 1"),
            (self.prefetch_seconds > 0, "prefetch_seconds", "must be above 0 s"),
        ]
        for ok, name, detail in checks:
            if not ok:
                raise ConfigError(f"{detail}, got {getattr(self, name)}", field=f"TrustPolicy.{name}")


@dataclass(frozen=True)
class Limits:
    """What one peer may cost the coordinator. See docs/security.md for the memory formula."""

    max_connections: int = 2048  # every open websocket, authenticated or not (--max-connections)
    max_unauthenticated: int = 256  # connections that have not yet passed their hello
    max_observers: int = 8  # cleave status and link-test connections (operator tools)
    hello_timeout: float = 10.0  # seconds from the upgrade to an accepted hello
    pre_auth_frame: int = 16 << 10  # bytes of one frame before the hello is accepted
    idle_frame: int = 16 << 10  # ... from a device that holds no tile (a release of 1,024 ids is ~8 KiB)
    observer_frame: int = (8 << 20) + (16 << 10)  # ... from an observer: an 8 MiB link-test upload
    frame_slack: int = 16 << 10  # header room on top of the largest result a device may send
    result_grace: float = 60.0  # seconds a device may still send a result for a tile it lost
    max_queue: int = 2  # websocket frames buffered per connection before reading pauses
    control_queue: int = 64 << 10  # bytes of queued small frames before a peer counts as not reading
    outbound_queue: int = 64 << 20  # bytes queued for one peer (work included) before it is cut
    outbound_total: int = 512 << 20  # bytes queued for every peer together: past it the longest queue is cut
    write_timeout: float = 60.0  # seconds a peer may leave a frame unread before it is cut
    observer_idle: float = 60.0  # seconds an observer may stay connected without a request
    status_rows: int = 100  # devices listed in one status reply (the rest are counted)
    messages: Rate = Rate(200.0, 400.0)  # any frame from a device
    releases: Rate = Rate(16.0, 64.0)  # tile ids given back
    resends: Rate = Rate(8 << 20, 32 << 20)  # bytes of blocks a device may make the coordinator send again
    pauses: Rate = Rate(0.5, 4.0)  # pause and resume
    status: Rate = Rate(2.0, 5.0)  # status requests of an observer
    speedtest_bytes: Rate = Rate(16 << 20, 32 << 20)  # bytes an observer may ask the coordinator to send
    enrolments: Rate = Rate(5.0, 20.0)  # new identities, for the whole coordinator

    def __post_init__(self) -> None:
        if not 1 <= self.max_connections <= 1_000_000:
            raise ConfigError(
                f"must be between 1 and 1,000,000, got {self.max_connections}", field="Limits.max_connections"
            )
        checks = [
            (self.max_unauthenticated >= 1, "max_unauthenticated", "must be at least 1"),
            (self.pre_auth_frame >= 4096, "pre_auth_frame", "must be at least 4096 bytes"),
            (self.idle_frame >= self.pre_auth_frame, "idle_frame", "must be at least pre_auth_frame"),
            (self.observer_frame >= self.idle_frame, "observer_frame", "must be at least idle_frame"),
            (self.max_observers >= 1, "max_observers", "must be at least 1"),
            (self.max_queue >= 1, "max_queue", "must be at least 1"),
        ]
        for ok, name, detail in checks:
            if not ok:
                raise ConfigError(f"{detail}, got {getattr(self, name)}", field=f"Limits.{name}")

    # No kind of connection may outnumber all of them: a lower max_connections lowers these too
    # (derived, not stored, so ``dataclasses.replace`` of max_connections moves them).
    @property
    def unauthenticated(self) -> int:
        """Connections that may be open before their hello: ``max_unauthenticated``, at most all."""
        return min(self.max_unauthenticated, self.max_connections)

    @property
    def observers(self) -> int:
        """Observers that may be connected: ``max_observers``, at most all connections."""
        return min(self.max_observers, self.max_connections)


HEADROOM = 16  # connections past a cap that still get a close code rather than an abort
READ_CHUNK = 256 << 10  # asyncio reads at most this much from a socket at once
CONNECTION_OVERHEAD = 64 << 10  # per connection: objects, tasks, buffers (bench_hostile measured 24-26 KiB)


def inbound_per_connection(frame: int, limits: Limits) -> int:
    """Bytes one connection can make the coordinator hold on the way in with frames of at most
    ``frame`` bytes: ``max_queue`` complete frames buffered before reading pauses, one in the
    handler's hands and one under verification (the handler waits for its verdict before
    the next message), and the library's read buffer, which holds
    a partial frame or what one socket read brought in past the queue (at most ``READ_CHUNK``)."""
    return (limits.max_queue + 2) * frame + max(frame, READ_CHUNK)


TLS_OVERHEAD = 320 << 10  # per TLS connection: asyncio's 256 KiB read buffer, and OpenSSL's state


def peer_costs(limits: Limits, *, largest_result: int, tls: bool = False) -> dict[str, int]:
    """The most one connection of each kind can make the coordinator hold on the way in (and
    in fixed overhead), in bytes. What is queued for peers on the way out is bounded for all of
    them together (``outbound``, in ``memory_bound``).

    A device holding tiles may send frames of ``largest_result`` plus slack; any other
    authenticated device is held to ``idle_frame``, an observer to ``observer_frame``, and a
    connection that has not passed its hello (or is still in the websocket handshake, whose
    request is at most ``handshake_bytes()``) to ``pre_auth_frame``.
    """
    fixed = CONNECTION_OVERHEAD + (TLS_OVERHEAD if tls else 0)
    return {
        "unauthenticated": max(inbound_per_connection(limits.pre_auth_frame, limits), handshake_bytes()) + fixed,
        "observer": inbound_per_connection(limits.observer_frame, limits) + fixed,
        "idle_device": inbound_per_connection(limits.idle_frame, limits) + fixed,
        "working_device": inbound_per_connection(largest_result + limits.frame_slack, limits) + fixed,
    }


def memory_bound(
    limits: Limits, *, devices_holding: int, largest_result: int, largest_frame: int, tls: bool = False
) -> dict[str, int]:
    """The worst case, term by term, in bytes, beyond the job itself (weights, optimizer state,
    activations, the GEMM operands in flight) and the Python process: every connection the caps
    allow, each costing the most its kind can (``peer_costs``), plus everything queued for
    peers, which the server keeps under ``outbound_total`` (it cuts the longest queue past it:
    one frame of at most ``largest_frame`` can overshoot). ``devices_holding`` is how many
    devices hold tiles at once (at most the tiles in flight)."""
    from cleave.wire.messages import MAX_SPEEDTEST_BYTES

    cost = peer_costs(limits, largest_result=largest_result, tls=tls)
    unauth = limits.unauthenticated + HEADROOM
    observers = limits.observers
    devices = max(0, limits.max_connections + HEADROOM - unauth - observers)
    holding = min(devices_holding, devices)
    terms = {
        "unauthenticated": unauth * cost["unauthenticated"],
        "observers": observers * cost["observer"] + MAX_SPEEDTEST_BYTES,  # one shared buffer for link-test replies
        "idle_devices": (devices - holding) * cost["idle_device"],
        "working_devices": holding * cost["working_device"],
        "outbound": limits.outbound_total + largest_frame,
    }
    terms["total"] = sum(terms.values())
    return terms
