"""Devices the plan does not need sleep: which devices to send to standby, whom to wake, how long
their wakes take, and how long a sleeping device may stay silent. Pure rules and their state:
``now`` in, decisions out; ``Core`` sends the ``standby`` and ``wake`` messages and pauses or
resumes the device's seat with the scheduler.

A device goes to standby once it has held no tile and been no live GEMM's planned owner for
``StandbyPolicy.after`` seconds. It then beats every ``keepalive`` seconds, drops its cached
blocks (the coordinator forgets them too) and gets no work. It is planned like any other device,
its round trip lengthened by its wake latency (``wake_s``: measured from each ``wake`` to the
first frame after it; one more round trip before its first), so a plan that wants it pays for
the wait, and every sleeping device a new GEMM's plan names is woken before its tiles are queued.
Work that no awake device may take (tiles without a planned owner while every awake device is
busy or barred from them) wakes sleepers too, longest asleep first. Sleeping is never a fault: a
sleeping device counts as silent only after ``STANDBY_MISSES`` keep-alives.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from cleave.wire.codes import StandbyWhy
from cleave.wire.errors import ConfigError
from cleave.wire.messages import MAX_KEEPALIVE, MIN_KEEPALIVE, STANDBY_MISSES

# How much a new wake measurement moves a device's wake latency (an exponential mean: one slow
# wake, a GC pause say, is not the device's habit).
WAKE_WEIGHT = 0.5


@dataclass(frozen=True)
class StandbyPolicy:
    """When the coordinator sends an unneeded device to standby (``--standby-after``), and how
    often a sleeping device beats (``--standby-keepalive``)."""

    # Seconds a device has held no tile and been no live GEMM's planned owner before it is sent
    # to standby; 0: never. Long against a step's gaps (a checkpoint, an evaluation), so that
    # the devices a plan uses every step never sleep between its GEMMs.
    after: float = 30.0
    # Seconds between a sleeping device's heartbeats (``standby.keepalive``): a volunteer's
    # machine wakes its network once a minute, not every 2 s.
    keepalive: float = 60.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.after) and 0 <= self.after <= 86_400):
            raise ConfigError(f"must be between 0 (never) and 86400 s, got {self.after!r}", field="StandbyPolicy.after")
        if not (MIN_KEEPALIVE <= self.keepalive <= MAX_KEEPALIVE):
            raise ConfigError(
                f"must be between {MIN_KEEPALIVE:g} and {MAX_KEEPALIVE:g} s, got {self.keepalive!r}",
                field="StandbyPolicy.keepalive",
            )

    @property
    def silence(self) -> float:
        """Seconds a sleeping device may go unheard before it counts as silent (dropped, 4008)."""
        return STANDBY_MISSES * self.keepalive


class Sleepers:
    """Who sleeps, who is being woken, what each live GEMM's plan names, and each device's wake
    latency. Every method is O(1) but ``planned``/``done`` (O(owners of the GEMM))."""

    def __init__(self, policy: StandbyPolicy | None = None) -> None:
        self.policy = policy or StandbyPolicy()
        self.asleep: dict[int, float] = {}  # device -> since when, in the order they fell asleep
        self.waking: dict[int, float] = {}  # device -> when its wake was sent, until it is heard
        self.wake_s: dict[int, float] = {}  # device -> its wake latency, measured
        self.worked: dict[int, float] = {}  # device -> when it last took or returned work (or joined, or woke)
        self._planned: dict[int, int] = {}  # device -> live GEMMs whose plans name it
        self._plans: dict[int, frozenset[int]] = {}  # live GEMM -> the devices its plan names
        self.sent = 0  # standby messages sent
        self.woken = 0  # wake messages sent

    # ------------------------------------------------------------------ devices

    def joined(self, device: int, now: float) -> None:
        """A device connected: it has ``after`` seconds to be given work."""
        self.worked[device] = now

    def left(self, device: int) -> None:
        """A device is gone: forget it (its wake latency too: a new connection is measured anew)."""
        self.asleep.pop(device, None)
        self.waking.pop(device, None)
        self.wake_s.pop(device, None)
        self.worked.pop(device, None)
        self._planned.pop(device, None)

    def working(self, device: int, now: float) -> None:
        """It was leased a tile, or a result of it came in."""
        self.worked[device] = now

    def is_asleep(self, device: int) -> bool:
        """It was sent to standby and has not been woken since."""
        return device in self.asleep

    def is_planned(self, device: int) -> bool:
        """A live GEMM's plan names it."""
        return bool(self._planned.get(device))

    def is_resting(self, device: int) -> bool:
        """Asleep, or woken and not heard since: on its keep-alive's clock."""
        return device in self.asleep or device in self.waking

    def due(self, device: int, idle: bool, gemms_out: bool, now: float) -> StandbyWhy | None:
        """Whether ``device`` (``idle``: connected, not paused, holding no tile and none queued as
        its own) should go to standby now, and why: idle for ``after`` seconds and named by no
        live GEMM's plan (``gemms_out``: the job has GEMMs out, which leave it out)."""
        after = self.policy.after
        if not after or not idle or device in self.asleep or device in self.waking or self._planned.get(device):
            return None
        if now - self.worked.get(device, now) < after:
            return None
        return StandbyWhy.UNPLANNED if gemms_out else StandbyWhy.IDLE

    def sleep(self, device: int, now: float) -> None:
        """``standby`` was sent to it."""
        self.asleep[device] = now
        self.sent += 1

    def wake(self, device: int, now: float) -> None:
        """``wake`` was sent to it: it has ``after`` seconds to be given work before it may sleep again."""
        self.asleep.pop(device, None)
        self.waking[device] = now
        self.worked[device] = now
        self.woken += 1

    def heard(self, device: int, now: float) -> float | None:
        """A frame came from ``device``: the first after a wake is its answer. Returns that wake's
        latency (seconds from the wake to the answer), or None."""
        sent = self.waking.pop(device, None)
        if sent is None:
            return None
        latency = max(0.0, now - sent)
        old = self.wake_s.get(device)
        self.wake_s[device] = latency if old is None else old + WAKE_WEIGHT * (latency - old)
        return latency

    def silence(self, device: int, awake: float) -> float:
        """Seconds ``device`` may go unheard before it is dropped as silent: ``awake`` (the
        heartbeat timeout) for an awake device, ``STANDBY_MISSES`` keep-alives for one at rest."""
        return max(awake, self.policy.silence) if self.is_resting(device) else awake

    def beat(self, device: int, awake: float) -> float:
        """Seconds between the coordinator's heartbeats to ``device`` (as it sends its own)."""
        return self.policy.keepalive if device in self.asleep else awake

    def latency(self, device: int, rtt: float) -> float:
        """Seconds a plan that wants ``device`` waits for it on top of its round trip: none when
        awake; when at rest, its measured wake latency, else one more round trip (``rtt``)."""
        if not self.is_resting(device):
            return 0.0
        return self.wake_s.get(device, rtt)

    def longest_asleep(self) -> Iterator[int]:
        """Sleeping devices, longest asleep first: the order to wake them in for work without an
        owner (take what is needed, then wake them: waking changes this order)."""
        return iter(self.asleep)

    # ------------------------------------------------------------------ plans

    def planned(self, gemm: int, owners: Iterable[int]) -> list[int]:
        """A GEMM's plan names ``owners``: none of them sleeps while it is live. Returns those
        asleep now: the caller wakes them."""
        named = frozenset(owners)
        if not named:
            return []
        self._plans[gemm] = named
        for d in named:
            self._planned[d] = self._planned.get(d, 0) + 1
        return sorted(d for d in named if d in self.asleep)

    def done(self, gemm: int) -> None:
        """A GEMM completed (or was dropped): its plan's owners may sleep again."""
        for d in self._plans.pop(gemm, ()):
            left = self._planned.get(d, 0) - 1
            if left > 0:
                self._planned[d] = left
            else:
                self._planned.pop(d, None)
