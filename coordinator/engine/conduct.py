"""A device's conduct: one copy of the rules by which it earns tiles and loses them, for the live
``Core`` and the simulator alike.

``Standing`` is an identity's recent record (probation, slots earned, leases lost, cool-offs);
``Pace`` is how fast the coordinator sees the device turn work around (the running estimates that
set its deadlines and its prefetch window). ``Conduct`` applies the rules to both and tells the
scheduler: a device's slots after each change (the regrade), its pace after each verified result,
whether a device that lost a race must be cut for stalling, and what a late or revoked lease costs
it. Pure: no store, no messages, no clock but the ``now`` and arrival times passed in.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from cleave.coordinator.engine.limits import TokenBucket, TrustPolicy, cooloff
from cleave.coordinator.engine.profiles import CLAIM_GFLOPS, UNPROVEN_FACTOR
from cleave.coordinator.engine.scheduler import Hold, Scheduler, Seat

EMA = 0.2  # weight of a new observation in a device's running estimates
MAX_SECONDS_PER_GFLOP = 10.0  # slower turnarounds than this are not waited for any longer


@dataclass
class Standing:
    """An identity's recent record in this process (bans and revocations are in the store)."""

    verified_total: int  # over every job, from the store at first sight, then counted here
    recent: deque[bool] = field(default_factory=deque)  # its last results: True verified, False rejected
    grown: int = 0  # verified results since it was last sent back to one slot
    taken_in_a_row: int = 0  # leases taken back since its last verified result
    unanswered: int = 0  # leases that ended without its result (lost to a copy, taken back) since then
    given_back: int = 0  # releases since its last verified result (pauses and departures do not count)
    cuts: int = 0
    cooloff_until: float = 0.0
    budgets: tuple[TokenBucket, TokenBucket, TokenBucket] | None = None  # releases, resends, reconnects

    def on_probation(self, trust: TrustPolicy) -> bool:
        """Whether it has yet to return ``trust.probation_tiles`` verified results (over every job)."""
        return self.verified_total < trust.probation_tiles

    def slots(self, trust: TrustPolicy, asked: int) -> int:
        """Tiles it may hold now: earned by verified work, never more than it asked for."""
        if self.on_probation(trust):
            return 1
        return max(1, min(asked, trust.max_slots, trust.first_slots + self.grown // trust.grow_every))

    def verified(self, trust: TrustPolicy) -> None:
        """A result of its passed verification."""
        self._remember(True, trust)
        self.verified_total += 1
        self.grown += 1
        self.taken_in_a_row = 0
        self.unanswered = 0
        self.given_back = 0

    def rejected(self, trust: TrustPolicy) -> bool:
        """Counts a failed result; True when the identity must be banned."""
        probation = self.on_probation(trust)
        self._remember(False, trust)
        rejects = sum(1 for ok in self.recent if not ok)
        return rejects >= (1 if probation else trust.ban_rejects)

    def gave_back(self, trust: TrustPolicy) -> bool:
        """It gave tiles back (one release); True when that is past its
        ``trust.give_backs`` in a row without a verified result: it then counts as a lease taken
        back. A cut does not refill the allowance; only a verified result does."""
        self.given_back += 1
        return self.given_back > trust.give_backs

    def late(self) -> None:
        """A lease passed its deadline: back to one slot until it earns more again."""
        self.grown = 0

    def taken_back(self, trust: TrustPolicy) -> bool:
        """A lease was revoked; True when the identity must be cut."""
        self.taken_in_a_row += 1
        overtaken = self.overtaken(trust)
        return self.taken_in_a_row >= trust.cut_after or overtaken

    def overtaken(self, trust: TrustPolicy) -> bool:
        """A lease went to another copy without its result: back to its first slots; True when
        too many in a row mean it holds tiles without computing them (it must be cut)."""
        self.unanswered += 1
        self.grown = 0
        limit = trust.cut_unanswered if self.on_probation(trust) else trust.cut_unanswered_trusted
        return self.unanswered >= limit

    def cut(self, trust: TrustPolicy, now: float) -> float:
        """Cut it: it may come back after the returned number of seconds (doubling each time,
        at most ``trust.cooloff_max``). An identity with no cut for ``cooloff_max`` after its
        last cool-off ended starts again from ``trust.cooloff``: an honest device cut now and
        then over months does not wait ten minutes for every blip."""
        if self.cuts and now >= self.cooloff_until + trust.cooloff_max:
            self.cuts = 0
        self.cuts += 1
        self.taken_in_a_row = self.unanswered = 0
        wait = cooloff(trust.cooloff, trust.cooloff_max, self.cuts)
        self.cooloff_until = now + wait
        return wait

    def _remember(self, ok: bool, trust: TrustPolicy) -> None:
        self.recent.append(ok)
        while len(self.recent) > trust.window:
            self.recent.popleft()


@dataclass
class Pace:
    """How fast the coordinator sees a device turn work around: running estimates (weight
    ``EMA`` per observation) of its seconds per GFLOP from lease to result, which sets its
    deadlines, and of the seconds between its verified results, which bounds its slots to what it
    verifies within the prefetch window."""

    seconds_per_gflop: float
    result_gap: float | None = None
    verified_at: float | None = None  # when its last verified result arrived

    @classmethod
    def unproven(cls, claimed_gflops: float) -> Pace:
        """Until it has returned work, a device is taken to be ``UNPROVEN_FACTOR`` times slower
        than its own claim, bounded to ``CLAIM_GFLOPS``: a claim only sets its first deadlines."""
        claim = min(max(claimed_gflops, CLAIM_GFLOPS[0]), CLAIM_GFLOPS[1])
        return cls(UNPROVEN_FACTOR / claim)

    def verified(self, arrived: float, leased_at: float, flops: float) -> None:
        """A result of ``flops`` leased at ``leased_at`` arrived at ``arrived`` and was verified."""
        if self.verified_at is not None:  # its throughput: seconds between verified results
            gap = min(arrived - self.verified_at, MAX_SECONDS_PER_GFLOP)
            self.result_gap = gap if self.result_gap is None else (1 - EMA) * self.result_gap + EMA * gap
        self.verified_at = arrived
        gflop = flops / 1e9
        if gflop > 0:
            turnaround = (1 - EMA) * self.seconds_per_gflop + EMA * (arrived - leased_at) / gflop
            self.seconds_per_gflop = min(turnaround, MAX_SECONDS_PER_GFLOP)


class Conducted(Protocol):
    """What the rules read of a device: the live Core's ``DeviceState`` and the simulator's device."""

    id: int
    asked: int  # the most tiles its owner wants in flight
    standing: Standing
    pace: Pace


class Conduct:
    """The rules both the live ``Core`` and the simulator run, over the one ``Scheduler`` they
    drive: every change to a device's standing or pace reaches the scheduler here, and nowhere
    else."""

    def __init__(self, sched: Scheduler, trust: TrustPolicy) -> None:
        self.sched = sched
        self.trust = trust

    def seat(
        self,
        device: int,
        standing: Standing,
        pace: Pace,
        asked: int,
        *,
        paused: bool = False,
        down_rate: float = 0.0,
        up_rate: float = 0.0,
        batch: int = 1,
    ) -> Seat:
        """A device joins: its seat, with the slots its record has earned, its pace, its links
        and the most tiles it takes in one frame."""
        return self.sched.join(
            device,
            slots=standing.slots(self.trust, asked),
            seconds_per_gflop=pace.seconds_per_gflop,
            trusted=not standing.on_probation(self.trust),
            paused=paused,
            down_rate=down_rate,
            up_rate=up_rate,
            batch=batch,
        )

    def slots(self, dev: Conducted) -> int:
        """Its slots: what its record has earned, and no more than it verifies in a prefetch
        window at its measured throughput."""
        slots = dev.standing.slots(self.trust, dev.asked)
        gap = dev.pace.result_gap
        if gap is not None and gap > 0:
            slots = min(slots, max(1, math.ceil(self.trust.prefetch_seconds / gap)))
        return slots

    def regrade(self, dev: Conducted) -> None:
        """Tell the scheduler the device's slots and trust after a change to its record."""
        self.sched.update(dev.id, slots=self.slots(dev), trusted=not dev.standing.on_probation(self.trust))

    def verified(self, dev: Conducted, arrived: float, leased_at: float, flops: float) -> None:
        """A result of ``dev`` passed verification: its record, its pace and its slots."""
        dev.standing.verified(self.trust)
        dev.pace.verified(arrived, leased_at, flops)
        self.regrade(dev)
        if flops > 0:
            self.sched.update(dev.id, seconds_per_gflop=dev.pace.seconds_per_gflop)

    def settled(
        self,
        winner: Conducted,
        arrived: float,
        leased_at: float,
        flops: float,
        losers: Iterable[tuple[Conducted, bool]],
    ) -> list[Conducted]:
        """A tile is settled: ``winner``'s result (leased at ``leased_at``, arrived at
        ``arrived``) was verified first, and each loser's copy lost the race (``answered``: its
        own result was being checked). Returns the stallers to cut once the tile is settled."""
        self.verified(winner, arrived, leased_at, flops)
        return [dev for dev, answered in losers if self.lost_race(dev, answered=answered)]

    def lost_race(self, dev: Conducted, *, answered: bool) -> bool:
        """Another copy of a tile ``dev`` held was verified first. A device whose own result is
        being checked (``answered``) only loses slots it may no longer need; one that never
        answers is overtaken, and True means it has been too many times in a row: a staller to
        cut once the tile is settled everywhere."""
        if not answered and dev.standing.overtaken(self.trust):
            return True
        self.regrade(dev)
        return False

    def rejected(self, dev: Conducted) -> bool:
        """A result of ``dev`` failed verification; True when its identity must be banned."""
        return dev.standing.rejected(self.trust)

    def gave_back(self, dev: Conducted, holds: Iterable[Hold], now: float, *, released: bool = True) -> bool:
        """``dev`` gave back (or lost by leaving) these leases, at once. Each it held for most of
        its deadline counts as unanswered, as if another copy had won: holding tiles until just
        before their deadlines and then letting go is stalling. And a release (``released``) is
        free only ``trust.give_backs`` times in a row without a verified result: past that, each
        counts as a lease taken back (its first slots, then a cut with a cool-off), so identities
        that bounce tiles between them early in their deadlines run out too. A pause or a
        departure (not ``released``) spends none of that allowance: each has its own rate limit
        (``Limits.pauses``, ``TrustPolicy.reconnects``), and an honest laptop whose owner keeps
        waking it, or whose Wi-Fi drops, must not be cut for it. True when it must be cut (else
        it is regraded)."""
        holds = list(holds)
        cut = False
        for hold in holds:
            if now - hold.leased_at > (hold.soft - hold.leased_at) / 2:
                cut = dev.standing.overtaken(self.trust) or cut
        if holds and released and dev.standing.gave_back(self.trust):
            cut = dev.standing.taken_back(self.trust) or cut
        if not cut:
            self.regrade(dev)
        return cut

    def late(self, dev: Conducted) -> None:
        """A lease of ``dev`` passed its deadline: back to its first slots."""
        dev.standing.late()
        self.regrade(dev)

    def taken_back(self, dev: Conducted) -> bool:
        """A lease of ``dev`` was revoked; True when it must be cut (else it is regraded)."""
        if dev.standing.taken_back(self.trust):
            return True
        self.regrade(dev)
        return False

    def cut(self, dev: Conducted, now: float) -> float:
        """``dev`` is cut: the seconds before it may come back (doubling with every cut)."""
        return dev.standing.cut(self.trust, now)
