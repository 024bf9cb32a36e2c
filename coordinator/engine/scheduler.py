"""Which unit goes to which device, and when: the coordinator's scheduling decisions, pure.

No tensors, no verification, no store, no clock: units are symbolic (an id, its GEMM, the keys of
its two input blocks, its FLOPs and the device the plan meant it for), devices are seats (slots,
speed, trust, the blocks they hold), and ``now`` comes in with every call. ``Core`` (the data
plane: tensors, verification, assembly, the store) and the simulator drive the same object, in
the spirit of Flower's ``Strategy`` and websockets' sans-I/O protocol.

Decisions come out as values, and the scheduler's own state already reflects them:

* ``Assign(device, unit, copy)``: lease ``unit`` to ``device`` (``copy`` says why a second holder);
* ``Overdue(device, unit)``: that lease just passed its deadline (the device's standing suffers);
* ``Reclaim(device, unit, reason)``: that lease is taken back; the device is barred from the unit.

Queue: every queued unit waits in its planned owner's own queue, or in the shared one when it
has none (no plan, or its owner went away). A device takes from its own queue first, then the
shared one, then steals from the tail of the longest own queue (the units its owner would reach
last, so the owner keeps the blocks it is about to reuse). A unit with no planned owner goes to a
connected device that already holds its input blocks: dW finds the X and dY pieces that forward
and dX left on devices (docs/architecture.md, "block reuse").

Cost per message (docs/architecture.md, "The scheduler"): with P devices and U outstanding units,
every decision is O(1) or O(log U) (the deadline heap, the steal heap); a dispatch does work in
proportion to the leases it makes, plus at most ``scan`` looks at units or devices that could not
be used. Nothing scans every device or every outstanding unit. ``bench/bench_scheduler.py``
measures it at 10,000 virtual devices.
"""

from __future__ import annotations

import enum
import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import Any

from cleave.db.store import Issued
from cleave.wire.errors import ConfigError


class _Miss(enum.Enum):
    """Why a free device took nothing."""

    NONE = 0  # it took a unit
    BARRED = 1  # everything queued is barred for it: it waits for the queue to change
    MERIT = 2  # every queue it may take from would get the unit sooner from its owner
    LATER = 3  # its look at the shared queue was cut short: it looks again at the next dispatch's retries
    UNSEEN = 4  # this dispatch's steal looks were spent before it had its look: set aside unseen


RETRY = 8  # devices whose look was cut short, and devices set aside, that look again at an assign
# Devices set aside on merit (they would return every unit later than its owner) look again at
# most this often (seconds), RETRY at a time: what changes that answer (an owner slowing, pausing
# or leaving) is seen at the server's tick. Looking at every assign, with the look that new
# GEMMs trigger, took 60-75% of a simulation's time at 1,024 devices (and that work per dispatch
# on the live loop).
RETRY_EVERY = 0.05
# A device that let a lease go late and lost it (to a copy, or taken back) is planned no new
# units for this many heartbeats, or until its next result: a live one answers within them, a
# crashed one is not handed the next GEMM's units to sit on (a small job's crashed device cost
# its step 2 s a GEMM so: docs/simulation.md). Bounded, so a slow device is never left idle.
DOUBT_HEARTBEATS = 2


@dataclass(frozen=True)
class FaultPolicy:
    """How long the coordinator waits before it stops trusting a device or a lease."""

    heartbeat: float = 0.0  # seconds between heartbeats each way; 0: min(2, heartbeat_timeout / 5)
    # A device silent this long is presumed frozen. Generous: a heartbeat queues behind a whole
    # result frame, and a 16 MB dW partial takes ~15 s on a 1 MB/s home uplink. Frozen devices
    # cost little meanwhile: their tiles are copied as soon as their deadlines pass.
    heartbeat_timeout: float = 30.0
    lease_floor: float = 2.0  # every lease deadline is at least this long
    lease_factor: float = 4.0  # ... and this many times the device's expected time for the tile
    max_wait: float = 120.0  # ... of which the expected part is at most this (deadlines are bounded)
    speculate_after: float = 0.05  # a tile out this long, and 2x what an idle device would need,
    speculate_factor: float = 2.0  # ... may be copied to that idle device
    max_copies: int = 2  # open leases of one tile through speculation: the original and one copy

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_timeout < float("inf"):
            raise ConfigError(
                f"must be a number of seconds above 0, got {self.heartbeat_timeout}",
                field="FaultPolicy.heartbeat_timeout",
            )
        checks = [
            (
                self.heartbeat == 0 or 0 < self.heartbeat < self.heartbeat_timeout,
                "heartbeat",
                f"must be above 0 and below heartbeat_timeout ({self.heartbeat_timeout:g} s), got {self.heartbeat}",
            ),
            (0 < self.lease_floor < float("inf"), "lease_floor", f"must be above 0 s, got {self.lease_floor}"),
            (1 <= self.lease_factor < float("inf"), "lease_factor", f"must be at least 1, got {self.lease_factor}"),
            (0 < self.max_wait < float("inf"), "max_wait", f"must be above 0 s, got {self.max_wait}"),
            (self.max_copies >= 1, "max_copies", f"must be at least 1, got {self.max_copies}"),
        ]
        for ok, name, detail in checks:
            if not ok:
                raise ConfigError(detail, field=f"FaultPolicy.{name}")

    @property
    def beat(self) -> float:
        """Seconds between heartbeats each way: ``heartbeat`` if given, else five beats in a
        timeout, at most 2 s apart. Derived here, not stored, so ``dataclasses.replace`` of the
        timeout moves it too."""
        return self.heartbeat or min(2.0, self.heartbeat_timeout / 5)

    def window(self, expected: float) -> float:
        """Seconds from lease to deadline for work expected to take ``expected`` seconds."""
        return self.lease_floor + self.lease_factor * min(expected, self.max_wait)


# --------------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class Assign:
    """Lease ``unit`` to ``device``: from the queue, or a copy of a tile another device holds."""

    device: int
    unit: int
    copy: Issued | None = None  # None: from the queue; else why another holder's tile is copied


@dataclass(frozen=True)
class Overdue:
    """``device``'s lease of ``unit`` passed its deadline (a copy may go out)."""

    device: int
    unit: int


@dataclass(frozen=True)
class Reclaim:
    """Take ``unit`` back from ``device``: it held it past twice its deadline (or late, while a
    free device could take it)."""

    device: int
    unit: int
    reason: str


Decision = Assign | Overdue | Reclaim


# --------------------------------------------------------------------------- state


@dataclass(frozen=True)
class UnitSpec:
    """A unit as the scheduler sees it: no tensors, only what a decision needs."""

    id: int
    gemm: int
    a: str  # key of its A block
    b: str  # key of its B block
    flops: int
    owner: int | None = None  # the device the plan meant it for; None: whoever is free
    down_bytes: int = 0  # its input blocks, all of them (a device holding some needs fewer)
    up_bytes: int = 0  # its result


@dataclass(eq=False)
class Hold:
    """One open lease: its deadline (``soft``: late, copy it) and ``hard`` (take it back)."""

    seq: int  # unique per lease: identifies it in the deadline heap
    leased_at: float
    soft: float
    hard: float
    late: bool = False
    copied: bool = False  # a copy went out because this one was late


@dataclass(eq=False)
class _Unit:
    spec: UnitSpec
    home: int | None = None  # whose own queue it waits in (None: the shared queue)
    queued: bool = True
    holders: dict[int, Hold] = field(default_factory=dict)
    barred: set[int] = field(default_factory=set)


@dataclass(eq=False)
class Seat:
    """A device as the scheduler sees it."""

    id: int
    slots: int  # the most units it may hold now (the data plane's decision, from its standing)
    seconds_per_gflop: float  # expected turnaround of a lease, per GFLOP
    trusted: bool = True  # off probation: copies of late units go to trusted devices first
    paused: bool = False
    # Its leases past their deadline and not ended yet: while any, new units are not queued for
    # it (it may have crashed or frozen, and would hold them until found out).
    late: int = 0
    # ... and, once such a lease ended without its result (another copy won, or it was taken
    # back), until this time (``DOUBT_HEARTBEATS`` heartbeats later) or its next result.
    doubted_until: float = 0.0
    full: bool = False  # its block budget is spent: it finishes what it holds first
    inflight: dict[int, float] = field(default_factory=dict)  # unit -> leased at
    own: deque[int] = field(default_factory=deque)  # planned units waiting for it (lazily pruned)
    own_count: int = 0  # of which still queued and still its own
    blocks: set[str] = field(default_factory=set)  # keys of the blocks it holds
    nothing_at: int = -1  # queue version at which it found nothing it may take
    down_rate: float = 0.0  # bytes/s of its links as last estimated (0: not known)
    up_rate: float = 0.0
    batch: int = 1  # the most units it takes in one work frame (its hello's batch)
    # Seconds it held at least one unit (up to ``held_since``, when it last went from holding
    # nothing to holding work): the energy books book a device's draw for these only.
    held_s: float = 0.0
    held_since: float | None = None

    def held(self, now: float) -> float:
        """Seconds it has held work since it joined, up to ``now``."""
        return self.held_s + (max(0.0, now - self.held_since) if self.held_since is not None else 0.0)

    def holds(self, now: float) -> None:
        """Its leases changed at ``now``: start or stop its held-work clock."""
        if self.inflight and self.held_since is None:
            self.held_since = now
        elif not self.inflight and self.held_since is not None:
            self.held_s += max(0.0, now - self.held_since)
            self.held_since = None

    @property
    def refill(self) -> int:
        """Free slots it needs before more units are leased to it while it still holds some: a
        device that batches is topped up in runs of half its slots (one work frame, one result
        frame back, one verifier batch), not a unit a frame; it computes what it holds
        meanwhile. A device that holds nothing takes work at once."""
        return max(1, min(self.batch, self.slots) // 2)

    @property
    def free(self) -> int:
        """Units it may take now (none while paused, or over its block budget with work in hand)."""
        if self.paused or (self.full and self.inflight):
            return 0  # over its memory budget: finish what it has first (never starve it though)
        return self.slots - len(self.inflight)

    def expected(self, flops: int) -> float:
        """Seconds a unit of ``flops`` is expected to take it, lease to result."""
        return flops / 1e9 * self.seconds_per_gflop

    def transfer(self, spec: UnitSpec) -> float:
        """Seconds its links need for a unit's blocks and result, none of them held (0 where a
        link is not known). Its pace, measured or claimed, is per GFLOP: a device that has not
        returned work yet is paced by its claimed compute alone, and a link-bound device's
        unit takes far longer than that."""
        down = spec.down_bytes / self.down_rate if self.down_rate > 0 else 0.0
        up = spec.up_bytes / self.up_rate if self.up_rate > 0 else 0.0
        return down + up


class Scheduler:
    """Queue, leases, deadlines and copies over symbolic units and seats."""

    def __init__(self, faults: FaultPolicy | None = None, *, scan: int = 64) -> None:
        self.faults = faults or FaultPolicy()
        self.scan = scan  # looks at unusable units or devices per dispatch phase, at most
        self.seats: dict[int, Seat] = {}
        self.units: dict[int, _Unit] = {}  # units of live GEMMs that are not done
        # Units of live GEMMs done, with the devices barred from them: ``reopen`` may queue one again.
        self._done: dict[int, tuple[UnitSpec, set[int]]] = {}
        self._gemm_units: dict[int, list[int]] = {}
        self._shared: deque[int] = deque()  # queued units with no home (lazily pruned)
        self._queued = 0
        self._owned = 0  # of which in an own queue (the sum of the seats' ``own_count``)
        self.version = 0  # moves whenever units are queued: devices that found nothing look again
        self._ready: OrderedDict[int, None] = OrderedDict()  # seats with a free slot, FIFO
        self._blocked: list[int] = []  # free seats barred from everything queued at this version
        # Free seats that could take a unit but should not now (it would come back later than
        # from its planned owner), or whose look at the shared queue was cut short: they look
        # again when their own state or the queue changes, and a few at every ``assign``.
        self._deferred: OrderedDict[int, None] = OrderedDict()
        # Free seats that looked at every queue they may take from and would return each unit
        # later than its owner (``_sooner``): a new GEMM has them look again only if they could
        # beat one of its owners (``_could_steal``), and a few look again every ``RETRY_EVERY``.
        self._aside: OrderedDict[int, bool] = OrderedDict()  # True: on merit; False: unseen
        self._steal: list[tuple[int, int]] = []  # heap (-own_count, seat), lazily updated
        self._deadlines: list[tuple[float, int, int, int]] = []  # heap: (when, hold seq, unit, seat)
        self._late: OrderedDict[int, None] = OrderedDict()  # units with a late, uncopied lease
        self._thin: OrderedDict[int, None] = OrderedDict()  # outstanding units short of their copies
        self._holders_of: dict[str, set[int]] = {}  # block key -> seats holding it
        self._barred_units: set[int] = set()  # units some device may not take (it failed them)
        self._seq = 0
        self._looks = scan  # steal looks left in this dispatch (``assign``)
        self._now = 0.0  # the latest time a caller gave: a lease ended by a caller that gives none ends then
        self._retry_at = 0.0  # deferred devices look again at the first assign from then

    # ------------------------------------------------------------------ views

    @property
    def queued(self) -> int:
        """Units waiting for a device."""
        return self._queued

    @property
    def unowned(self) -> int:
        """Units waiting in the shared queue: no planned owner is here for them. O(1)."""
        return self._queued - self._owned

    @property
    def offered(self) -> bool:
        """Whether some device with a free slot may still take a unit (it has not looked yet,
        or looks again later); False when every free device is barred from what is queued. A
        device set aside (``_aside``) found nothing in the shared queue it may take: it does not
        count (the unowned units wait for someone else, a sleeper say)."""
        return bool(self._ready or self._deferred)

    def holding(self) -> Iterable[tuple[int, dict[int, Hold]]]:
        """Every unit that is out, with its open leases."""
        return ((uid, u.holders) for uid, u in self.units.items() if u.holders)

    def holders(self, unit: int) -> dict[int, Hold]:
        """The open leases of ``unit``, by device."""
        u = self.units.get(unit)
        return u.holders if u is not None else {}

    def hold(self, unit: int, device: int) -> Hold | None:
        """``device``'s open lease of ``unit``, if any."""
        return self.holders(unit).get(device)

    def next_deadline(self) -> float | None:
        """When ``expire`` may next have something to say (a stale entry can make it early):
        the simulator's virtual clock jumps there instead of ticking."""
        return self._deadlines[0][0] if self._deadlines else None

    # ------------------------------------------------------------------ devices

    def join(
        self,
        device: int,
        *,
        slots: int,
        seconds_per_gflop: float,
        trusted: bool = True,
        paused: bool = False,
        down_rate: float = 0.0,
        up_rate: float = 0.0,
        batch: int = 1,
    ) -> Seat:
        """A device joins with its slots, expected pace, links (bytes/s; 0: not known) and the
        most units it takes in one frame (``Seat.refill``)."""
        seat = Seat(
            device, slots, seconds_per_gflop, trusted, paused, down_rate=down_rate, up_rate=up_rate, batch=batch
        )
        self.seats[device] = seat
        self._refresh(seat)
        return seat

    def links(self, device: int, down_rate: float, up_rate: float) -> None:
        """Its links as now estimated (bytes/s; 0: not known)."""
        seat = self.seats.get(device)
        if seat is not None:
            seat.down_rate, seat.up_rate = down_rate, up_rate

    def leave(self, device: int) -> list[int]:
        """A device is gone: its leases end (their units queue again unless another device holds
        them), its planned units go to the shared queue. Returns the units it held."""
        seat = self.seats.pop(device, None)
        if seat is None:
            return []
        self._ready.pop(device, None)
        self._deferred.pop(device, None)
        self._aside.pop(device, None)
        held = list(seat.inflight)
        for uid in held:
            self._end(uid, device, bar=False)
        self._disown(seat)
        for key in seat.blocks:
            holders = self._holders_of.get(key)
            if holders is not None:
                holders.discard(device)
                if not holders:
                    del self._holders_of[key]
        return held

    def _disown(self, seat: Seat) -> None:
        """A seat's planned units go to the front of the shared queue, in its order."""
        mine = []
        for uid in seat.own:
            u = self.units.get(uid)
            if u is not None and u.queued and u.home == seat.id:
                u.home = None
                mine.append(uid)
        seat.own.clear()
        self._owned -= seat.own_count
        seat.own_count = 0
        self._shared.extendleft(reversed(mine))
        if mine:
            self._moved()

    def update(
        self,
        device: int,
        *,
        slots: int | None = None,
        seconds_per_gflop: float | None = None,
        trusted: bool | None = None,
        paused: bool | None = None,
        full: bool | None = None,
    ) -> None:
        """A device's slots, pace, trust, pause or block budget changed (``None``: unchanged)."""
        seat = self.seats.get(device)
        if seat is None:
            return
        if slots is not None:
            seat.slots = slots
        if seconds_per_gflop is not None:
            seat.seconds_per_gflop = seconds_per_gflop
        if trusted is not None:
            seat.trusted = trusted
        if paused is not None:
            seat.paused = paused
            if paused:  # its planned units must not wait for its owner's whim
                self._disown(seat)
        if full is not None:
            seat.full = full
        self._refresh(seat)

    def holds_block(self, device: int, key: str) -> None:
        """``device`` holds the block ``key`` now (units that read it prefer it)."""
        seat = self.seats.get(device)
        if seat is not None and key not in seat.blocks:
            seat.blocks.add(key)
            self._holders_of.setdefault(key, set()).add(device)

    def drops_blocks(self, device: int, keys: Iterable[str]) -> None:
        """``device`` no longer holds these blocks."""
        seat = self.seats.get(device)
        if seat is None:
            return
        for key in keys:
            if key in seat.blocks:
                seat.blocks.discard(key)
                holders = self._holders_of.get(key)
                if holders is not None:
                    holders.discard(device)
                    if not holders:
                        del self._holders_of[key]

    def _refresh(self, seat: Seat) -> None:
        """Its state changed: it may take work again (a deferred seat looks again too)."""
        if seat.id not in self.seats:
            return
        self._deferred.pop(seat.id, None)
        self._aside.pop(seat.id, None)
        free = seat.free
        if free <= 0:
            self._ready.pop(seat.id, None)
        elif seat.id not in self._ready and seat.nothing_at != self.version:
            # Once offered work it stays on offer until full (a run is leased in one dispatch).
            if not seat.inflight or free >= seat.refill:
                self._ready[seat.id] = None

    # ------------------------------------------------------------------ work

    def add_gemm(self, gemm: int, units: Sequence[UnitSpec], *, front: bool = False) -> None:
        """Queue a GEMM's units. A unit's owner is the plan's device if it is connected, else a
        connected device already holding both of its blocks (or one), else nobody. ``front``:
        ahead of every unit queued before (in their order): someone waits on this GEMM, while
        the queued ones (deferred weight gradients) are needed only at the end of the step."""
        ids = []
        homes: set[int] = set()
        for spec in reversed(units) if front else units:
            u = _Unit(spec)
            self.units[spec.id] = u
            ids.append(spec.id)
            owner = self.seats.get(spec.owner) if spec.owner is not None else None
            home = spec.owner if owner is not None and not self._doubted(owner) else self._affinity(spec)
            self._enqueue(u, home, front=front)
            if home is not None:
                homes.add(home)
        self._gemm_units[gemm] = ids[::-1] if front else ids
        if len(self._steal) > 2 * len(self.seats) + 64:  # stale entries: rebuild, O(P) amortised
            self._steal = [(-s.own_count, d) for d, s in self.seats.items() if s.own_count > 0]
            heapq.heapify(self._steal)
        for home in homes:
            heapq.heappush(self._steal, (-self.seats[home].own_count, home))
        self._moved(self._could_steal(units, homes))
        # Planned owners look first: at scale most free seats have no unit of this GEMM and may
        # not steal one (``_sooner``), and behind ``scan`` of them an owner would wait for the
        # next dispatch (O(homes) here, so a dispatch still does bounded work).
        for home in homes:
            if home in self._ready:
                self._ready.move_to_end(home, last=False)

    def drop_gemm(self, gemm: int, now: float | None = None) -> None:
        """The GEMM is done (or abandoned) at ``now``: forget its units."""
        at = self._at(now)
        for uid in self._gemm_units.pop(gemm, ()):
            self._done.pop(uid, None)
            u = self.units.pop(uid, None)
            if u is None:
                continue
            if u.queued:
                self._queued -= 1
                self._own_less(u)
            for device, hold in u.holders.items():
                seat = self.seats.get(device)
                if seat is not None:
                    if hold.late:
                        self._unlate(seat)
                    seat.inflight.pop(uid, None)
                    seat.holds(at)
                    self._refresh(seat)
            self._late.pop(uid, None)
            self._thin.pop(uid, None)

    def _unlate(self, seat: Seat) -> None:
        """A late lease of ``seat`` ended without its result: it stays doubted a while."""
        seat.late -= 1
        seat.doubted_until = max(seat.doubted_until, self._now + DOUBT_HEARTBEATS * self.faults.beat)

    def _doubted(self, seat: Seat) -> bool:
        """Not to be planned units now: a lease of it is late, or one it let go late was lost lately."""
        return seat.late > 0 or seat.doubted_until > self._now

    def _affinity(self, spec: UnitSpec) -> int | None:
        a, b = self._holders_of.get(spec.a, set()), self._holders_of.get(spec.b, set())
        both = a & b if len(a) <= len(b) else b & a
        pool = [d for d in (both or a or b) if not self._doubted(self.seats[d])]
        if not pool:
            return None
        # The least loaded holder; ties by id so the choice does not depend on set order.
        return min(pool, key=lambda d: (self.seats[d].own_count, d))

    def _enqueue(self, u: _Unit, home: int | None, *, front: bool = False) -> None:
        u.queued = True
        u.home = home
        self._queued += 1
        if home is None:
            if front:
                self._shared.appendleft(u.spec.id)
            else:
                self._shared.append(u.spec.id)
            return
        seat = self.seats[home]
        if front:
            seat.own.appendleft(u.spec.id)
        else:
            seat.own.append(u.spec.id)
        seat.own_count += 1
        self._owned += 1

    def _own_less(self, u: _Unit) -> None:
        if u.home is not None:
            seat = self.seats.get(u.home)
            if seat is not None:
                seat.own_count -= 1
                self._owned -= 1

    def _moved(self, could_steal: Callable[[Seat], bool] | None = None) -> None:
        """Units were queued: devices that found nothing look again (amortised: each was put
        aside by a look that found nothing). ``could_steal``: the new units are all planned
        owners' (``_could_steal``); a device refused every queue on merit looks again only if
        it passes it, so a GEMM's submission costs O(devices set aside) arithmetic, not a steal
        look each (at 1,024 devices and thousands of GEMMs a step, that was most of a
        simulation's time and the same work on the live loop)."""
        self.version += 1
        keep: OrderedDict[int, bool] = OrderedDict()
        for device in [*self._blocked, *self._deferred]:
            seat = self.seats.get(device)
            if seat is not None:
                self._refresh(seat)
        for device, merit in list(self._aside.items()):
            seat = self.seats.get(device)
            if seat is not None and merit and could_steal is not None and not could_steal(seat):
                keep[device] = True
            elif seat is not None:
                self._refresh(seat)
        self._blocked.clear()
        self._deferred.clear()
        self._aside = keep

    def _could_steal(self, units: Sequence[UnitSpec], homes: set[int]) -> Callable[[Seat], bool] | None:
        """A test no looser than ``_sooner`` at this instant for a device set aside on merit:
        could it steal any of these new units from its owner? None (everyone looks) unless every
        unit went to its planned, unpaused owner. Bounds: the owners' queues and paces as now,
        the smallest unit, a block of these units held. An owner's queue or pace can grow later
        without a new GEMM (it takes a shared unit, its slots or pace change): the devices set
        aside see that at their retries (``RETRY`` every ``RETRY_EVERY``), and a late owner's
        queue goes to the shared queue (``expire``)."""
        if not units or any(
            spec.owner is None or spec.owner not in homes or self.seats[spec.owner].paused for spec in units
        ):
            return None
        least = min(spec.flops for spec in units)
        most = max(spec.flops for spec in units)
        down = min(spec.down_bytes for spec in units)
        up = min(spec.up_bytes for spec in units)
        theirs = max((s.own_count + len(s.inflight)) * s.expected(most) for s in (self.seats[h] for h in homes))
        keys = {spec.a for spec in units} | {spec.b for spec in units}

        def could(seat: Seat) -> bool:
            if seat.id in homes:
                return True
            if seat.blocks.isdisjoint(keys) and theirs <= self.faults.max_wait:
                return False  # a thief holding no block takes only from an owner far behind (``_sooner``)
            mine = (len(seat.inflight) + 1) * seat.expected(least)
            mine += down / seat.down_rate if seat.down_rate > 0 else 0.0
            mine += up / seat.up_rate if seat.up_rate > 0 else 0.0
            return mine < theirs

        return could

    # ------------------------------------------------------------------ leases

    def _lease(self, seat: Seat, uid: int, now: float) -> None:
        u = self.units[uid]
        # Queued behind its other units on the device: the deadline allows for them too.
        window = self.faults.window(seat.expected(u.spec.flops) * (len(seat.inflight) + 1))
        self._seq += 1
        hold = Hold(self._seq, now, now + window, now + 2 * window)
        u.holders[seat.id] = hold
        if len(u.holders) < self.faults.max_copies:
            self._thin.setdefault(uid, None)
        else:
            self._thin.pop(uid, None)
        heapq.heappush(self._deadlines, (hold.soft, hold.seq, uid, seat.id))
        seat.inflight[uid] = now
        seat.holds(self._at(now))
        self._refresh(seat)

    def on_wire(self, unit: int, device: int, now: float) -> None:
        """``unit``'s work frame for ``device`` goes on the wire at ``now``: its lease counts from
        then (deadlines, speculation, the device's pace). A lease decided while its frame waited
        behind the coordinator's busy event loop is neither late nor copied for that wait: the
        live loop decides a lease when it gets to it and frames it at once. O(log U)."""
        u = self.units.get(unit)
        hold = u.holders.get(device) if u is not None else None
        if hold is None or hold.late or now <= hold.leased_at:
            return
        self._postpone(unit, device, hold, now - hold.leased_at)
        hold.leased_at = now

    def result_in(self, unit: int, device: int, now: float, read: float) -> None:
        """``device``'s result for ``unit`` reached the coordinator at ``now`` and waits until
        ``read`` for its event loop to read it: the lease's clock stops meanwhile (the live loop
        reads what arrived before its tick looks at deadlines), so the wait is not the device's
        lateness, and the unit is not copied for it (its result is in hand). O(log U)."""
        u = self.units.get(unit)
        hold = u.holders.get(device) if u is not None else None
        if hold is None or read <= now:
            return
        self._thin.pop(unit, None)
        self._postpone(unit, device, hold, read - now)

    def _postpone(self, unit: int, device: int, hold: Hold, by: float) -> None:
        """Move ``hold``'s deadlines ``by`` seconds later (its old heap entry goes stale)."""
        hold.hard += by
        if not hold.late:
            hold.soft += by
        self._seq += 1
        hold.seq = self._seq
        heapq.heappush(self._deadlines, (hold.hard if hold.late else hold.soft, hold.seq, unit, device))

    def _at(self, now: float | None) -> float:
        if now is not None:
            self._now = max(self._now, now)
        return self._now

    def _end(self, uid: int, device: int, *, bar: bool, now: float | None = None) -> bool:
        """``device``'s lease of ``uid`` ends without a result. True if the unit queued again."""
        u = self.units.get(uid)
        seat = self.seats.get(device)
        if seat is not None:
            seat.inflight.pop(uid, None)
            seat.holds(self._at(now))
            self._refresh(seat)
        if u is None or (hold := u.holders.pop(device, None)) is None:
            return False
        if hold.late and seat is not None:
            self._unlate(seat)
        if bar:
            u.barred.add(device)
            self._barred_units.add(uid)
        if u.holders:
            if len(u.holders) < self.faults.max_copies:
                self._thin.setdefault(uid, None)
            return False
        self._thin.pop(uid, None)
        self._late.pop(uid, None)
        # Its planned home had its chance: whoever is free next, before anything newer (it has
        # waited longest, and its GEMM cannot finish without it).
        self._enqueue(u, None, front=True)
        self._moved()
        return True

    def release(self, unit: int, device: int, *, bar: bool = False, now: float | None = None) -> bool:
        """The device gave the unit back, failed it, or lost it to a reject (``bar``: never to
        it again). True if the unit is queued again."""
        return self._end(unit, device, bar=bar, now=now)

    def done(self, unit: int, device: int, now: float | None = None) -> list[int]:
        """``device``'s result for ``unit`` was verified: every other holder loses the race.
        Returns those devices (they are told to drop it)."""
        at = self._at(now)
        u = self.units.pop(unit, None)
        if u is None:
            return []
        self._done[unit] = (u.spec, u.barred)
        losers = [d for d in u.holders if d != device]
        for d, hold in u.holders.items():
            seat = self.seats.get(d)
            if seat is not None:
                if d == device:
                    seat.late -= hold.late
                    seat.doubted_until = 0.0  # it answers: plans may count on it again
                elif hold.late:
                    self._unlate(seat)
                seat.inflight.pop(unit, None)
                seat.holds(at)
                self._refresh(seat)
        u.holders.clear()
        self._late.pop(unit, None)
        self._thin.pop(unit, None)
        self._barred_units.discard(unit)
        return losers

    def reopen(self, unit: int, device: int) -> bool:
        """``device``'s result for ``unit``, taken as ``done``, failed a later check (its row
        band's): queue the unit again ahead of everything, never to that device. False if its
        GEMM was dropped meanwhile, or the unit is not done."""
        done = self._done.pop(unit, None)
        if done is None:
            return False
        u = _Unit(done[0], barred=done[1] | {device})  # as barred as before, and from this device
        self.units[unit] = u
        self._barred_units.add(unit)
        self._enqueue(u, None, front=True)
        self._moved()
        return True

    def stuck(self) -> list[int]:
        """Queued units that no device here may take: every connected one failed them (O(units
        with a bar)); a paused device that did not will take them once it resumes. Nobody would
        ever lease them; the caller must decide."""
        able = set(self.seats)
        if not able:
            return []
        self._barred_units &= self.units.keys()  # dropped GEMMs' units
        return sorted(uid for uid in self._barred_units if self.units[uid].queued and able <= self.units[uid].barred)

    def unbar(self, unit: int) -> None:
        """Let every device take ``unit`` again."""
        u = self.units.get(unit)
        if u is not None:
            u.barred.clear()
            self._barred_units.discard(unit)
            self._moved()

    # ------------------------------------------------------------------ dispatch

    def expire(self, now: float) -> list[Decision]:
        """Deadlines that passed, in order (O(log U) each): a late lease is ``Overdue`` (and
        buys a copy), and its device's planned units still queued go to the shared queue (a
        late owner, slowed or hostile, must not hold them: a thief holding no block never
        steals from it, ``_sooner``); a lease at twice its deadline is taken back."""
        out: list[Decision] = []
        self._at(now)  # every dispatch starts here: the clock ``_doubted`` reads
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq, uid, device = heapq.heappop(self._deadlines)
            u = self.units.get(uid)
            hold = u.holders.get(device) if u is not None else None
            if hold is None or hold.seq != seq or device not in self.seats:
                continue  # that lease already ended
            if not hold.late:
                hold.late = True
                self.seats[device].late += 1
                self._late[uid] = None
                heapq.heappush(self._deadlines, (hold.hard, seq, uid, device))
                out.append(Overdue(device, uid))
                if self.seats[device].own_count:
                    self._disown(self.seats[device])
            else:
                self._end(uid, device, bar=True, now=now)  # it goes to someone else, never straight back
                out.append(Reclaim(device, uid, "held past twice its deadline"))
        return out

    def assign(self, now: float) -> Iterator[Assign]:
        """Lease queued units to devices with free slots, one per device per round (FIFO, except
        that a new GEMM's planned owners move to the front: ``add_gemm``). A
        generator: the caller acts on each lease (which may fill a device's block budget, see
        ``update``) before the next is decided."""
        misses = 0
        # Looks at other devices' queues, shared by every steal of this dispatch: with long
        # queues that no free device may steal from (each would return the unit later than its
        # owner), each of ``scan`` free devices looking at ``scan`` queues would be scan^2 work.
        self._looks = self.scan
        retries: list[OrderedDict[int, Any]] = [self._deferred] * min(RETRY, len(self._deferred))  # looks cut short
        if now >= self._retry_at:  # owners slow down, pause, leave
            self._retry_at = now + RETRY_EVERY
            retries += [self._aside] * min(RETRY, len(self._aside))
        for waiting in retries:
            device, _ = waiting.popitem(last=False)
            if device in self.seats and self.seats[device].free > 0:
                self._ready[device] = None
        while self._queued > 0 and self._ready:
            device = next(iter(self._ready))
            seat = self.seats[device]
            uid, why = self._take(seat)
            if uid is None:
                misses += 1
                self._ready.pop(device)
                if why is _Miss.BARRED:  # everything queued is barred for it: not asked until the queue changes
                    seat.nothing_at = self.version
                    self._blocked.append(device)
                elif why is _Miss.LATER:
                    self._deferred[device] = None
                else:  # MERIT, or UNSEEN: a new GEMM has it look again regardless
                    self._aside[device] = why is _Miss.MERIT
                if misses > self.scan:
                    break
                continue
            self._ready.move_to_end(device)  # before the lease, which may take it off the list
            self._lease(seat, uid, now)
            yield Assign(device, uid)

    def _take(self, seat: Seat) -> tuple[int | None, _Miss]:
        """The next unit for ``seat``: its own, else the shared queue's, else a steal. With
        none, why (``_Miss``)."""
        while seat.own:
            uid = seat.own.popleft()
            u = self.units.get(uid)
            if u is not None and u.queued and u.home == seat.id:
                return self._dequeue(u), _Miss.NONE
        looked = 0
        skipped: list[int] = []
        found = None
        while self._shared and looked < self.scan:
            uid = self._shared.popleft()
            u = self.units.get(uid)
            if u is None or not u.queued or u.home is not None:
                continue  # stale: done, dropped, or already taken
            if seat.id in u.barred:
                skipped.append(uid)
                looked += 1
                continue
            found = self._dequeue(u)
            break
        cut_short = found is None and looked >= self.scan and bool(self._shared)
        if cut_short:  # behind them may be one it may take: they go last, it looks again later
            self._shared.extend(skipped)
        else:
            self._shared.extendleft(reversed(skipped))
        if found is not None:
            return found, _Miss.NONE
        if self._looks <= 0:  # this dispatch's steal looks are spent (as ``_steal_for`` would find)
            return None, _Miss.LATER if cut_short else _Miss.UNSEEN if self._steal else _Miss.BARRED
        stolen, passed, unseen = self._steal_for(seat)
        if stolen is not None:
            return stolen, _Miss.NONE
        if cut_short:
            return None, _Miss.LATER
        if unseen:
            return None, _Miss.UNSEEN
        return None, _Miss.MERIT if passed else _Miss.BARRED

    def _steal_for(self, seat: Seat) -> tuple[int | None, bool, bool]:
        """The last unit of the longest own queue it may take (lazy heap: stale entries are
        dropped; at most ``scan`` queues looked at). Also whether a queue was passed over
        because taking from it would not have helped, and whether queues were left unseen
        because this dispatch's looks are spent."""
        looked = 0
        passed: list[tuple[int, int]] = []
        found = None
        while self._steal and looked < self.scan and self._looks > 0:
            self._looks -= 1
            neg, victim = heapq.heappop(self._steal)
            other = self.seats.get(victim)
            if other is None or other.own_count <= 0:
                continue
            if -neg != other.own_count:  # stale: its current length goes back in
                heapq.heappush(self._steal, (-other.own_count, victim))
                looked += 1
                continue
            looked += 1
            # The victim keeps what it would reach first; this device takes from the tail.
            while other.own:
                uid = other.own[-1]
                u = self.units.get(uid)
                if u is None or not u.queued or u.home != victim:
                    other.own.pop()
                    continue
                if (
                    victim != seat.id
                    and seat.id not in u.barred
                    and (u.spec.owner != victim or self._sooner(seat, other, u))
                ):
                    other.own.pop()
                    found = self._dequeue(u)
                break
            if other.own_count > 0:
                passed.append((-other.own_count, victim))
            if found is not None:
                break
        for entry in passed:
            heapq.heappush(self._steal, entry)
        # Queues left unseen (this dispatch's looks are spent): look again later.
        return found, bool(passed), found is None and self._looks <= 0 and bool(self._steal)

    def _sooner(self, thief: Seat, victim: Seat, u: _Unit) -> bool:
        """Would ``thief`` return the victim's last planned unit before the victim reaches it?
        If not, taking it would lengthen the step: the thief stays idle (a plan's slow device
        is not handed a fast one's last tile). A thief holding neither of the unit's blocks
        takes it only from an owner that would reach it after ``FaultPolicy.max_wait`` (the
        longest a lease is expected to take: an owner that slowed down or holds too much): both
        blocks would leave the coordinator again, on the loop and the link every device shares,
        for a small gain to one device (at 1,024 devices such steals sent 5x the plan's bytes and
        made a loop-bound step 3x longer: docs/simulation.md)."""
        if victim.paused:
            return True
        spec = u.spec
        theirs = (victim.own_count + len(victim.inflight)) * victim.expected(spec.flops)
        if theirs <= self.faults.max_wait and spec.a not in thief.blocks and spec.b not in thief.blocks:
            return False  # decided before its own time is worked out (most looks, at 1,024 devices)
        return (len(thief.inflight) + 1) * thief.expected(spec.flops) + thief.transfer(spec) < theirs

    def _dequeue(self, u: _Unit) -> int:
        u.queued = False
        self._queued -= 1
        self._own_less(u)
        u.home = None
        return u.spec.id

    def copies(self, now: float) -> Iterator[Decision]:
        """Copies for units whose lease ran late and, when nothing is queued, for stragglers:
        to free devices, trusted ones first. When every copy slot of a late unit is taken, its
        most overdue holder loses it, so no set of devices can hold a unit forever. A generator,
        like ``assign``: a take-back may cut its device, and what follows must see that."""
        if not (self._ready or self._deferred or self._aside) or (not self._late and (self._queued or not self._thin)):
            return
        f = self.faults
        looked = 0
        for uid in list(islice(self._late, self.scan)):
            if looked >= self.scan or not (self._ready or self._deferred or self._aside):
                break
            looked += 1
            u = self.units.get(uid)
            if u is None or not u.holders:
                self._late.pop(uid, None)
                continue
            late = [d for d, h in u.holders.items() if h.late]
            fresh = [d for d in late if not u.holders[d].copied]
            if not fresh:
                self._late.pop(uid, None)
                continue
            seat = self._idle_for(u)
            if seat is None:
                continue
            if len(u.holders) >= f.max_copies + 1:
                holders = u.holders  # the unit's, in the key below (a closure does not keep ``u``'s narrowing)
                victim = min(late, key=lambda d: holders[d].soft)
                self._end(uid, victim, bar=True, now=now)
                yield Reclaim(victim, uid, "late while another device was free")
                if not u.holders or uid not in self.units:  # queued again, for assign
                    continue
                if seat.id not in self.seats or seat.free <= 0 or seat.id in u.holders:
                    continue  # the take-back changed things: this unit waits for the next look
            for d in fresh:
                if d in u.holders:
                    u.holders[d].copied = True
            self._late.pop(uid, None)
            self._lease(seat, uid, now)
            yield Assign(seat.id, uid, Issued.DEADLINE)
        if self._queued or not self._thin:
            return
        # Nothing queued: copy the oldest units that have been out much longer than a free
        # device would need (a device known to be slow earns no extra patience).
        looked = 0
        for uid in list(islice(self._thin, self.scan)):
            if looked >= self.scan or not (self._ready or self._deferred or self._aside):
                break
            looked += 1
            u = self.units.get(uid)
            if u is None or not u.holders or len(u.holders) >= f.max_copies:
                self._thin.pop(uid, None)
                continue
            if any(h.late for h in u.holders.values()):
                continue  # a late lease is copied by the rule above
            seat = self._idle_for(u)
            if seat is None:
                continue
            oldest = min(h.leased_at for h in u.holders.values())
            if now - oldest < max(f.speculate_after, f.speculate_factor * seat.expected(u.spec.flops)):
                break  # younger units come later in this order
            self._lease(seat, uid, now)
            yield Assign(seat.id, uid, Issued.SPECULATIVE)

    def _idle_for(self, u: _Unit) -> Seat | None:
        """A free device that neither holds nor is barred from ``u``: trusted first, then the
        longest free. Bounded: at most ``scan`` devices are looked at."""
        best: Seat | None = None
        for i, device in enumerate(chain(self._ready, self._deferred, self._aside)):
            if i >= self.scan:
                break
            seat = self.seats[device]
            if device in u.holders or device in u.barred or seat.free <= 0:
                continue
            if best is None or (seat.trusted, seat.free) > (best.trusted, best.free):
                best = seat
                if seat.trusted:
                    break
        return best
