"""Carrying out the scheduler's decisions: the one loop both the live ``Core`` and the simulator
run, so a rule fixed here is fixed in both.

``Dispatch`` asks the scheduler what to do now (late leases and leases taken back, queued tiles
to devices with free slots, copies of late tiles and stragglers, in that order) and does it one
decision at a time, each able to change what the next one sees. What the rules decide stays here:
a late lease slows its device's standing (``Conduct.late``) unless it waited on a relay the device
reported; a lease taken back counts against the device and, in a row, cuts it (``Conduct.cut``:
it may come back after a cool-off). What a driver does about a decision (write the store, frame
the work, schedule an arrival on a virtual clock) is its ``Hands``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Generic, Protocol, TypeVar

from cleave.coordinator.engine.conduct import Conduct, Conducted
from cleave.coordinator.engine.scheduler import Assign, Decision, Overdue, Reclaim

D = TypeVar("D", bound=Conducted)


class Hands(Protocol[D]):
    """What a driver does for the rules. Each returns what it has to send (the live
    coordinator's ``Outbound`` messages; the simulator, which sends nothing, an empty list)."""

    def device(self, device_id: int) -> D | None:
        """The connected device, or None once it is gone."""
        ...

    def vanished(self, device_id: int, unit: int) -> None:
        """A decision for a device cut earlier in this batch: the scheduler let its tiles go."""
        ...

    def lease(self, dev: D, unit: int, now: float) -> list[Any]:
        """A first lease of a queued unit: send its work (the store's row may wait for ``flush``)."""
        ...

    def flush(self, now: float) -> list[Any]:
        """Record the first leases made since the last flush, before any other decision."""
        ...

    def copy(self, dev: D, unit: int, copy: str, now: float) -> list[Any]:
        """A copy of an outstanding unit (``copy`` says why): record it and send its work."""
        ...

    def excused(self, dev: D, unit: int) -> bool:
        """Whether the device held ``unit`` waiting on a relay it reported: its lateness is not its own."""
        ...

    def take_back(self, dev: D, unit: int, reason: str, excused: bool, now: float) -> list[Any]:
        """The scheduler revoked the lease (the device is barred from the unit): end it, cancel
        its work, and, unless ``excused``, count it against the device's reliability."""
        ...

    def on_relay(self, dev: D, unit: int) -> bool:
        """Whether ``unit`` waited on blocks named on the device's relay."""
        ...

    def drop(self, dev: D, why: str, wait: float, on_relay: bool, now: float) -> list[Any]:
        """Close a cut device (it may come back in ``wait`` seconds); its tiles go to others."""
        ...


class Dispatch(Generic[D]):
    """The scheduler's decisions, carried out by a driver's ``Hands`` under the conduct rules."""

    def __init__(self, conduct: Conduct, hands: Hands[D]) -> None:
        self.conduct = conduct
        self.hands = hands
        self._running = False

    def __call__(self, now: float) -> list[Any]:
        """What the scheduler decides now, done. Never re-entered: a device cut inside it only
        changes state, and this loop picks up what that freed."""
        if self._running:
            return []
        self._running = True
        try:
            sched = self.conduct.sched
            out = self.apply(sched.expire(now), now)
            out.extend(self.apply(sched.assign(now), now))
            out.extend(self.apply(sched.copies(now), now))
            if sched.queued:  # a late tile was taken back with no copy left out
                out.extend(self.apply(sched.assign(now), now))
            return out
        finally:
            self._running = False

    def apply(self, decisions: Iterable[Decision], now: float) -> list[Any]:
        """Carry out decisions one at a time: each may change what the next one sees (a lease
        fills a device's block budget, a take-back cuts a device)."""
        hands = self.hands
        out: list[Any] = []
        for decision in decisions:
            dev = hands.device(decision.device)
            if dev is None:  # cut earlier in this batch: the scheduler has let its tiles go already
                hands.vanished(decision.device, decision.unit)
                continue
            if isinstance(decision, Assign) and decision.copy is None:
                out.extend(hands.lease(dev, decision.unit, now))
            elif isinstance(decision, Overdue):
                if not hands.excused(dev, decision.unit):  # late waiting on a relay it reported: the relay's doing
                    self.conduct.late(dev)
            else:  # the store sees the first leases before it, in order
                out.extend(hands.flush(now))
                if isinstance(decision, Assign):
                    out.extend(hands.copy(dev, decision.unit, decision.copy or "", now))
                elif isinstance(decision, Reclaim):
                    out.extend(self._take_back(dev, decision, now))
        out.extend(hands.flush(now))
        return out

    def _take_back(self, dev: D, decision: Reclaim, now: float) -> list[Any]:
        """Leases taken back in a row cut the device; one held waiting on a relay it reported
        counts for nothing (the relay's slowness, not its stall)."""
        excused = self.hands.excused(dev, decision.unit)
        out = self.hands.take_back(dev, decision.unit, decision.reason, excused, now)
        if not excused and self.conduct.taken_back(dev):  # else it is regraded
            on_relay = self.hands.on_relay(dev, decision.unit)
            out.extend(self.cut(dev, "its tiles kept running past their deadlines", now, on_relay=on_relay))
        return out

    def cut(self, dev: D, why: str, now: float, *, on_relay: bool = False) -> list[Any]:
        """Disconnect a device that holds tiles without returning them; it may come back after a
        cool-off (doubling with every cut). ``on_relay``: the lease taken back last waited on
        blocks named on its relay, which may have been the slow one."""
        wait = self.conduct.cut(dev, now)
        return self.hands.drop(dev, why, wait, on_relay, now)
