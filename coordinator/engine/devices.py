"""A connected device as the engine sees it: its seat with the scheduler, its conduct (standing
and pace), its allowances, the blocks it holds and its counters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cleave.coordinator.engine.blocks import BlockRef
from cleave.coordinator.engine.conduct import Pace, Standing
from cleave.coordinator.engine.limits import TokenBucket
from cleave.coordinator.engine.scheduler import Seat
from cleave.wire.codes import Name


@dataclass
class DeviceState:
    """One connected device (``Conducted``: the rules of coordinator/engine/conduct.py read its
    ``standing``, ``pace`` and ``asked``)."""

    id: int
    identity: int
    name: str
    asked: int  # the most tiles its owner wants in flight
    seat: Seat  # the scheduler's view: slots, tiles held, pause, speed
    standing: Standing
    pace: Pace  # its measured turnaround and result gap (the rules keep the seat's speed in step)
    device: str
    last_seen: float
    messages: TokenBucket
    releases: TokenBucket
    resends: TokenBucket  # bytes of blocks it may make the coordinator send again
    pauses: TokenBucket
    frame_limit: int  # the largest frame it may send now
    cancelled: dict[int, None] = field(default_factory=dict)  # recent cancelled tiles (ordered set)
    checking: set[int] = field(default_factory=set)  # tiles whose result is being verified
    unchecked: int = 0  # its results taken for their bands and not yet judged (``BandState.take``)
    blocks: set[str] = field(default_factory=set)  # keys of the blocks the device holds
    namespaces: dict[int, dict[str, int]] = field(default_factory=dict)  # source id -> {key: bytes} held
    forget: set[int] = field(default_factory=set)  # namespaces to drop, sent with the next Work
    bytes_down: int = 0
    bytes_up: int = 0
    tiles_done: int = 0
    tiles_rejected: int = 0
    compute_seconds: float = 0.0  # as reported by the device, verified tiles only
    last_sent: float = 0.0
    paused: str | None = None  # the owner's reason, while the device must not get work
    budget: int = 0  # bytes of cached blocks the device accepts (0: no limit)
    cached_bytes: int = 0
    gflop_verified: float = 0.0
    credit_sent: float = 0.0
    credit_at: float = 0.0
    big_until: float = 0.0  # until then it may still send a result for a tile it lost
    result_at: float = -math.inf  # when its last verified result arrived
    batch: int = 1  # the most tiles it takes in one work frame and answers in one (hello.batch, within its slots)
    excused: set[int] = field(default_factory=set)  # tiles in flight when its relay failed it: not its stall
    relayed: set[int] = field(default_factory=set)  # tiles whose work named blocks to take from its relay

    @property
    def inflight(self) -> dict[int, float]:
        """Tile id -> when it was leased (the scheduler's record)."""
        return self.seat.inflight

    @property
    def slots(self) -> int:
        """Tiles it may hold now (the scheduler's)."""
        return self.seat.slots

    @property
    def free(self) -> int:
        """Tiles it may take now."""
        return self.seat.free

    @property
    def seconds_per_gflop(self) -> float:
        """Running estimate of a lease's turnaround (transfer, queue, compute)."""
        return self.pace.seconds_per_gflop

    @property
    def verified_at(self) -> float | None:
        """When its last verified result arrived."""
        return self.pace.verified_at

    @property
    def result_gap(self) -> float | None:
        """Running estimate of the seconds between its verified results."""
        return self.pace.result_gap

    @property
    def full(self) -> bool:
        """Its cached blocks have reached the budget it stated."""
        return bool(self.budget) and self.cached_bytes >= self.budget

    def cancel(self, tile_id: int) -> None:
        """Its copy lost the race or was taken back: a late result is expected and ignored.
        Bounded, since a client that drops a cancelled tile before computing it never answers."""
        self.cancelled[tile_id] = None
        if len(self.cancelled) > 1024:
            del self.cancelled[next(iter(self.cancelled))]

    def hold(self, ref: BlockRef) -> None:
        """A work frame carried ``ref``: the device caches it from now on."""
        self.blocks.add(ref.key)
        self.namespaces.setdefault(ref.namespace, {})[ref.key] = ref.nbytes
        self.cached_bytes += ref.nbytes

    def drop(self, namespace: int) -> dict[str, int]:
        """Its blocks of ``namespace`` are dropped (told with its next work): {key: bytes} dropped."""
        keys = self.namespaces.pop(namespace, None)
        if keys is None:
            return {}
        self.blocks -= keys.keys()
        self.cached_bytes -= sum(keys.values())
        self.forget.add(namespace)
        return keys

    def lose(self, ref: BlockRef) -> None:
        """The device says it no longer holds ``ref``."""
        self.blocks.discard(ref.key)
        held = self.namespaces.get(ref.namespace, {})
        if ref.key in held:
            self.cached_bytes -= held.pop(ref.key)


class Departure(Name):
    """How a device's session ended, as far as the rules care: leaving and a coordinator that
    stops are nobody's fault; anything else (a closed connection, a cut) costs the device the
    tiles it held. A reason that is none of these values reads as ``CLOSED``."""

    LEFT = "left"  # it said leave
    SHUTDOWN = "coordinator stopped"  # the coordinator is going
    FINISHED = "job finished"  # the job is over: every device is sent away
    CLOSED = "connection closed"  # its connection closed or was cut (the reason given says why)

    @classmethod
    def of(cls, reason: str) -> Departure:
        """The departure a reason stands for (free text: ``CLOSED``)."""
        try:
            return cls(reason)
        except ValueError:
            return cls.CLOSED
