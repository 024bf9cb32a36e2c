"""The pure scheduler: queue, owners, stealing, deadlines, copies; and its books under random
fleets (hypothesis state machine). No tensors, no store, no clock."""

from __future__ import annotations

import dataclasses

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cleave.coordinator.engine.scheduler import (
    DOUBT_HEARTBEATS,
    Assign,
    FaultPolicy,
    Overdue,
    Reclaim,
    Scheduler,
    UnitSpec,
)
from cleave.db.store import Issued

FAULTS = FaultPolicy(lease_floor=1.0, lease_factor=2.0, speculate_after=0.5, speculate_factor=2.0)


def units(
    gemm: int,
    count: int,
    *,
    start: int = 0,
    flops: int = 10**9,
    owner: int | None = None,
    keys: tuple[str, str] | None = None,
) -> list[UnitSpec]:
    return [
        UnitSpec(
            start + i, gemm, keys[0] if keys else f"a{gemm}.{i}", keys[1] if keys else f"b{gemm}.{i}", flops, owner
        )
        for i in range(count)
    ]


def assigned(sched: Scheduler, now: float = 0.0) -> list[tuple[int, int]]:
    return [(a.device, a.unit) for a in sched.assign(now)]


def test_units_go_first_to_their_planned_owner_and_free_devices_steal_from_the_tail() -> None:
    s = Scheduler(FAULTS)
    s.join(1, slots=1, seconds_per_gflop=0.1)
    s.join(2, slots=1, seconds_per_gflop=0.1)
    s.holds_block(2, "x")  # a thief holds one of the units' blocks (``Scheduler._sooner``)
    s.add_gemm(7, units(7, 4, owner=1, keys=("x", "w")))
    got = dict(assigned(s))
    assert got[1] == 0  # its own queue, in order
    assert got[2] == 3  # a steal takes the unit the owner would reach last
    assert s.queued == 2
    assert s.done(0, 1) == []
    assert assigned(s) == [(1, 1)]
    s.done(3, 2)
    assert assigned(s) == [(2, 2)]


def test_a_device_that_batches_is_topped_up_in_runs_of_half_its_slots() -> None:
    """A device taking 8 tiles a frame gets 8 at first, nothing more until 4 are free, then 4 in
    one assign (one work frame); one that batches nothing is topped up a unit at a time."""
    s = Scheduler(FAULTS)
    s.join(1, slots=8, seconds_per_gflop=0.1, batch=8)
    s.join(2, slots=8, seconds_per_gflop=0.1)  # batch 1
    s.add_gemm(7, units(7, 40))
    got = assigned(s)
    assert sorted(d for d, _ in got) == [1] * 8 + [2] * 8
    mine = [u for d, u in got if d == 1]
    theirs = [u for d, u in got if d == 2]
    for unit in mine[:3]:
        s.done(unit, 1)
    s.done(theirs[0], 2)
    assert [d for d, _ in assigned(s)] == [2]  # 3 free of 8: not yet
    s.done(mine[3], 1)
    assert [d for d, _ in assigned(s)] == [1] * 4  # 4 free: a run of 4


def test_a_thief_whose_links_would_make_it_late_does_not_steal() -> None:
    """A device paced by its compute alone (it has not returned work yet) looks fast; its links
    count too: 32 MB down at 5 MB/s is 6.4 s, more than the owner needs for its whole queue."""

    def fleet(down_rate: float) -> Scheduler:
        s = Scheduler(FAULTS)
        s.join(1, slots=1, seconds_per_gflop=0.1)  # the owner: 0.1 s a unit
        s.join(2, slots=1, seconds_per_gflop=0.001, down_rate=down_rate, up_rate=down_rate)
        s.holds_block(2, "x")
        work = units(7, 4, owner=1, keys=("x", "w"))
        s.add_gemm(7, [dataclasses.replace(u, down_bytes=32 << 20, up_bytes=1 << 20) for u in work])
        return s

    assert dict(assigned(fleet(5e6))) == {1: 0}  # 6.4 s of links against 0.4 s: it waits
    assert dict(assigned(fleet(1e9))) == {1: 0, 2: 3}  # a fast link: it steals the tail
    s = fleet(5e6)
    s.links(2, 1e9, 1e9)  # its links as measured later
    assert dict(assigned(s)) == {1: 0, 2: 3}


def test_a_thief_holding_neither_block_of_a_planned_unit_never_steals_it() -> None:
    """However fast, a device holding neither of a planned unit's blocks leaves it to its owner:
    both blocks would leave the coordinator again, on the loop every device shares. Once it holds
    one (the GEMM's X rows, say), it steals the tail; a paused owner's units go to anyone."""
    s = Scheduler(FAULTS)
    s.join(1, slots=1, seconds_per_gflop=1.0)  # the owner: 1 s a unit, 40 of them
    s.join(2, slots=1, seconds_per_gflop=0.001)
    s.add_gemm(7, units(7, 40, owner=1, keys=("x", "w")))
    assert dict(assigned(s)) == {1: 0}
    s.holds_block(2, "w")
    s.done(0, 1)
    assert dict(assigned(s, 1.0)) == {1: 1, 2: 39}
    s.update(1, paused=True)
    s.join(3, slots=1, seconds_per_gflop=0.001)  # holds nothing: the paused owner's units are anyone's
    assert 3 in dict(assigned(s, 2.0))


def test_a_unit_without_an_owner_goes_to_a_device_holding_its_blocks() -> None:
    s = Scheduler(FAULTS)
    for d in (1, 2, 3):
        s.join(d, slots=1, seconds_per_gflop=0.1, paused=True)
    s.holds_block(2, "x")
    s.holds_block(3, "x")
    s.holds_block(3, "y")
    s.add_gemm(1, [UnitSpec(10, 1, "x", "y", 100), UnitSpec(11, 1, "x", "z", 100), UnitSpec(12, 1, "p", "q", 100)])
    for d in (1, 2, 3):
        s.update(d, paused=False)
    got = {unit: device for device, unit in assigned(s)}
    assert got[10] == 3  # it holds both blocks
    assert got[11] == 2  # a holder of one block (3 already has its own)
    assert got[12] == 1  # nobody holds them: the shared queue


def test_a_device_that_leaves_loses_only_its_leases_and_its_planned_units_go_to_others() -> None:
    s = Scheduler(FAULTS)
    s.join(1, slots=2, seconds_per_gflop=0.1)
    s.add_gemm(1, units(1, 5, owner=1))
    assert len(assigned(s)) == 2
    assert sorted(s.leave(1)) == [0, 1]
    assert s.queued == 5
    s.join(2, slots=5, seconds_per_gflop=0.1)
    assert sorted(u for _, u in assigned(s)) == [0, 1, 2, 3, 4]
    assert s.queued == 0


def test_a_released_unit_is_first_in_line_and_a_barred_device_never_gets_it_again() -> None:
    s = Scheduler(FAULTS)
    s.join(1, slots=1, seconds_per_gflop=0.1)
    s.add_gemm(1, units(1, 3))
    assert assigned(s) == [(1, 0)]
    assert s.release(0, 1, bar=True)
    assert assigned(s) == [(1, 1)]  # not 0: barred
    s.join(2, slots=1, seconds_per_gflop=0.1)
    assert assigned(s) == [(2, 0)]  # the released unit before the newer one


def test_a_done_unit_reopened_after_a_failed_check_keeps_its_bars_and_bars_its_device() -> None:
    s = Scheduler(FAULTS)
    s.join(1, slots=1, seconds_per_gflop=0.1)
    s.join(2, slots=1, seconds_per_gflop=0.1)
    s.add_gemm(1, units(1, 1))
    assert assigned(s) == [(1, 0)]
    assert s.release(0, 1, bar=True)  # device 1 failed it
    assert assigned(s) == [(2, 0)]
    assert s.done(0, 2) == []
    assert s.reopen(0, 2)  # device 2's result failed its band's check
    assert s.queued == 1 and assigned(s) == [] and s.stuck() == [0]  # barred for both: nobody may take it
    s.join(3, slots=1, seconds_per_gflop=0.1)
    assert assigned(s) == [(3, 0)]
    assert not s.reopen(0, 3)  # not done: nothing to reopen
    s.drop_gemm(1)
    assert not s.reopen(0, 3)


def test_a_gemm_queued_in_front_goes_before_units_queued_earlier_in_its_own_order() -> None:
    s = Scheduler(FAULTS)
    s.join(1, slots=1, seconds_per_gflop=0.1, paused=True)
    s.join(2, slots=1, seconds_per_gflop=0.1, paused=True)
    s.add_gemm(1, units(1, 3))  # a deferred weight gradient: shared queue
    s.add_gemm(2, units(2, 2, start=10, owner=1))  # an owned queue too
    s.add_gemm(3, units(3, 3, start=20), front=True)  # the trainer waits on this one
    s.add_gemm(4, units(4, 2, start=30, owner=1), front=True)
    s.update(1, paused=False)
    s.update(2, paused=False)
    order = []
    while s.queued:
        for device, unit in assigned(s):
            order.append(unit)
            s.done(unit, device)
    shared = [u for u in order if u < 10 or 20 <= u < 30]
    owned = [u for u in order if 10 <= u < 20 or u >= 30]
    assert shared == [20, 21, 22, 0, 1, 2]
    assert owned == [30, 31, 10, 11]


def test_a_device_barred_from_everything_queued_is_not_asked_again_until_the_queue_changes() -> None:
    s = Scheduler(FAULTS)
    s.join(1, slots=1, seconds_per_gflop=0.1)
    s.add_gemm(1, units(1, 1))
    assigned(s)
    s.release(0, 1, bar=True)
    assert assigned(s) == [] and 1 not in s._ready
    s.add_gemm(2, units(2, 1, start=5))
    assert assigned(s) == [(1, 5)]


def test_deadlines_pass_in_order_overdue_first_then_taken_back_at_twice() -> None:
    s = Scheduler(FAULTS)
    s.join(1, slots=1, seconds_per_gflop=1.0)  # 1 GFLOP unit: expects 1 s, deadline 1 + 2 * 1 = 3 s
    s.add_gemm(1, units(1, 1))
    assigned(s)
    hold = s.hold(0, 1)
    assert (hold.soft, hold.hard) == (3.0, 6.0)
    assert s.expire(2.9) == []
    assert s.expire(3.0) == [Overdue(1, 0)]
    assert s.expire(6.0) == [Reclaim(1, 0, "held past twice its deadline")]
    assert s.queued == 1 and not s.holders(0)
    assert assigned(s, 6.0) == []  # barred from it


def test_a_late_unit_is_copied_to_a_trusted_free_device_first() -> None:
    s = Scheduler(FAULTS)
    s.join(1, slots=1, seconds_per_gflop=1.0)
    s.add_gemm(1, units(1, 1))
    assigned(s)
    s.join(2, slots=1, seconds_per_gflop=1.0, trusted=False)
    s.join(3, slots=1, seconds_per_gflop=1.0, trusted=True)
    s.expire(3.0)
    assert list(s.copies(3.0)) == [Assign(3, 0, Issued.DEADLINE)]
    assert s.hold(0, 1).copied
    assert list(s.copies(3.1)) == []  # one copy per passed deadline


def test_when_every_copy_slot_is_taken_the_most_overdue_holder_loses_the_unit() -> None:
    s = Scheduler(FaultPolicy(lease_floor=1.0, lease_factor=1.0, max_copies=1))
    s.join(1, slots=1, seconds_per_gflop=1.0)
    s.add_gemm(1, units(1, 1))
    assigned(s)
    s.join(2, slots=1, seconds_per_gflop=0.5)
    s.expire(2.0)  # 1's deadline (1 + 1 s; taken back at 4 s)
    assert list(s.copies(2.0)) == [Assign(2, 0, Issued.DEADLINE)]  # 2's deadline: 2 + 1.5 s
    s.join(3, slots=1, seconds_per_gflop=1.0)
    s.expire(3.9)
    decisions = list(s.copies(3.9))
    assert decisions[0] == Reclaim(1, 0, "late while another device was free")
    assert decisions[1] == Assign(3, 0, Issued.DEADLINE)


def test_stragglers_are_copied_only_when_nothing_is_queued_and_they_are_old_enough() -> None:
    s = Scheduler(FAULTS)
    s.join(1, slots=1, seconds_per_gflop=10.0)  # slow: its deadline is far
    s.add_gemm(1, units(1, 1))
    assigned(s)
    s.join(2, slots=1, seconds_per_gflop=0.1)  # a free fast device: expects 0.1 s, copies after 0.5 s
    assert list(s.copies(0.4)) == []
    assert list(s.copies(0.6)) == [Assign(2, 0, Issued.SPECULATIVE)]
    assert s.done(0, 2) == [1]  # the slow holder lost the race
    assert not s.units and not s.seats[1].inflight


def test_paused_and_full_devices_get_nothing_new() -> None:
    s = Scheduler(FAULTS)
    s.join(1, slots=2, seconds_per_gflop=0.1, paused=True)
    s.add_gemm(1, units(1, 3))
    assert assigned(s) == []
    s.update(1, paused=False)
    got = s.assign(0.0)
    assert next(got) == Assign(1, 0)
    s.update(1, full=True)  # its block budget filled with that lease: it finishes it first
    assert list(got) == []
    s.done(0, 1)
    assert assigned(s) == [(1, 1)]  # never starved: with nothing held it gets one


def test_dropping_a_gemm_forgets_its_units() -> None:
    s = Scheduler(FAULTS)
    s.join(1, slots=1, seconds_per_gflop=0.1)
    s.add_gemm(1, units(1, 3))
    assigned(s)
    s.drop_gemm(1)
    assert s.queued == 0 and not s.units and not s.seats[1].inflight
    assert assigned(s) == []


# --------------------------------------------------------------------------- random fleets


class Books(RuleBasedStateMachine):
    """Random joins, leaves, results, releases, pauses and time; the books always balance and the
    scheduler is work-conserving."""

    def __init__(self) -> None:
        super().__init__()
        self.s = Scheduler(FaultPolicy(lease_floor=1.0, lease_factor=2.0, max_copies=2), scan=1000)
        self.now = 0.0
        self.next_device = 1
        self.next_unit = 0
        self.next_gemm = 1
        self.done: set[int] = set()
        self.barred: dict[int, set[int]] = {}

    def _act(self, decisions) -> None:
        for d in decisions:
            if isinstance(d, Assign):
                assert d.device not in self.barred.get(d.unit, set()), "a barred device got the unit"
                assert d.unit not in self.done
            elif isinstance(d, Reclaim):
                self.barred.setdefault(d.unit, set()).add(d.device)

    def _dispatch(self) -> None:
        self._act(self.s.expire(self.now))
        self._act(self.s.assign(self.now))
        self._act(self.s.copies(self.now))
        self._act(self.s.assign(self.now))

    @rule(slots=st.integers(1, 3), speed=st.floats(0.01, 5.0), trusted=st.booleans())
    def join(self, slots: int, speed: float, trusted: bool) -> None:
        self.s.join(self.next_device, slots=slots, seconds_per_gflop=speed, trusted=trusted)
        self.next_device += 1
        self._dispatch()

    @precondition(lambda self: self.s.seats)
    @rule(pick=st.integers(0, 10**6))
    def leave(self, pick: int) -> None:
        device = sorted(self.s.seats)[pick % len(self.s.seats)]
        self.s.leave(device)
        self._dispatch()

    @rule(count=st.integers(1, 12), owned=st.booleans(), pick=st.integers(0, 10**6))
    def submit(self, count: int, owned: bool, pick: int) -> None:
        owner = sorted(self.s.seats)[pick % len(self.s.seats)] if owned and self.s.seats else None
        self.s.add_gemm(self.next_gemm, units(self.next_gemm, count, start=self.next_unit, owner=owner))
        self.next_gemm += 1
        self.next_unit += count
        self._dispatch()

    @precondition(lambda self: any(seat.inflight for seat in self.s.seats.values()))
    @rule(pick=st.integers(0, 10**6), outcome=st.sampled_from(["done", "release", "reject"]))
    def answer(self, pick: int, outcome: str) -> None:
        held = sorted((u, d) for d, seat in self.s.seats.items() for u in seat.inflight)
        unit, device = held[pick % len(held)]
        if outcome == "done":
            losers = self.s.done(unit, device)
            assert device not in losers
            self.done.add(unit)
        else:
            bar = outcome == "reject"
            self.s.release(unit, device, bar=bar)
            if bar:
                self.barred.setdefault(unit, set()).add(device)
        self._dispatch()

    @precondition(lambda self: self.s.seats)
    @rule(pick=st.integers(0, 10**6), paused=st.booleans())
    def pause(self, pick: int, paused: bool) -> None:
        device = sorted(self.s.seats)[pick % len(self.s.seats)]
        self.s.update(device, paused=paused)
        if paused:
            for unit in list(self.s.seats[device].inflight):
                self.s.release(unit, device)
        self._dispatch()

    @rule(dt=st.floats(0.0, 10.0))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self._dispatch()

    @invariant()
    def books_balance(self) -> None:
        s = self.s
        queued = [u for u in s.units.values() if u.queued]
        assert s.queued == len(queued)
        assert s.unowned == sum(1 for u in queued if u.home is None)  # what wakes sleepers (engine/standby.py)
        for uid, u in s.units.items():
            assert uid not in self.done
            assert not (u.queued and u.holders), f"unit {uid} is queued and held"
            assert u.queued or u.holders, f"unit {uid} is lost: neither queued nor held"
            assert len(u.holders) <= s.faults.max_copies + 1
            for device in u.holders:
                assert device in s.seats and uid in s.seats[device].inflight
                assert device not in self.barred.get(uid, set())
        for device, seat in s.seats.items():
            assert len(seat.inflight) <= seat.slots
            for uid in seat.inflight:
                assert device in s.units[uid].holders
            live_own = sum(1 for u in s.units.values() if u.queued and u.home == device)
            assert seat.own_count == live_own
            # Its late leases, counted as they go late and end: what bars it from new plans.
            assert seat.late == sum(1 for u in s.units.values() if device in u.holders and u.holders[device].late)
            if seat.free > 0:  # work-conserving: a free device is never idle beside work it may take
                # ... except another's planned units that it would return later than their owner
                open_to_it = [
                    u.spec.id
                    for u in queued
                    if device not in u.barred
                    and not (u.home is not None and u.spec.owner == u.home and not s._sooner(seat, s.seats[u.home], u))
                ]
                assert not open_to_it, f"device {device} is free while {open_to_it} wait"


Books.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBooks = Books.TestCase


def test_a_slow_device_does_not_take_a_fast_devices_planned_unit_it_would_return_later() -> None:
    s = Scheduler(FAULTS)
    s.join(1, slots=1, seconds_per_gflop=0.1)  # fast: 0.1 s a unit
    s.join(2, slots=1, seconds_per_gflop=1.0)  # slow: 1 s a unit
    s.holds_block(2, "x")
    s.add_gemm(1, units(1, 4, owner=1, keys=("x", "w")))
    assert assigned(s) == [(1, 0)]  # the slow one would finish any of them after the fast one
    s.done(0, 1)
    s.add_gemm(2, units(2, 40, start=100, owner=1, keys=("x", "v")))  # a long queue: the slow one helps from its tail
    got = dict((d, u) for d, u in assigned(s))
    assert got[1] == 1 and got[2] == 139


def test_a_paused_owners_planned_units_go_to_the_others() -> None:
    s = Scheduler(FAULTS)
    s.join(1, slots=1, seconds_per_gflop=1e-4)  # claims to be very fast: planned everything
    s.join(2, slots=1, seconds_per_gflop=1.0)
    s.add_gemm(1, units(1, 6, owner=1))
    assigned(s)
    s.update(1, paused=True)
    s.release(0, 1)  # a pause gives back what it held
    got = []
    for _ in range(10):
        for d, u in assigned(s):
            got.append(u)
            s.done(u, d)
    assert s.queued == 0 and sorted(got) == [0, 1, 2, 3, 4, 5]


def test_a_device_that_declined_a_steal_looks_again_once_its_own_work_is_done() -> None:
    s = Scheduler(FAULTS)
    s.join(1, slots=4, seconds_per_gflop=0.1)
    s.join(2, slots=2, seconds_per_gflop=0.5)
    s.add_gemm(1, units(1, 2, owner=2))
    s.holds_block(2, "x")
    s.add_gemm(2, units(2, 12, start=10, owner=1, keys=("x", "w")))
    first = assigned(s)
    assert {d for d, _ in first} == {1, 2}
    s.update(1, seconds_per_gflop=5.0)  # the owner turned out slow
    for d, u in first:
        if d == 2:
            s.done(u, 2)  # its own work done: it looks again
    assert any(d == 2 for d, _ in assigned(s))


def test_more_barred_units_than_a_scan_ahead_of_the_one_a_device_may_take() -> None:
    s = Scheduler(FAULTS)
    s.join(1, slots=1, seconds_per_gflop=0.1)
    s.add_gemm(1, units(1, 1))  # the unit only device 2 may take
    assigned(s)
    s.release(0, 1, bar=True)
    s.update(1, paused=True)
    s.join(2, slots=80, seconds_per_gflop=0.1)
    s.add_gemm(2, units(2, 70, start=100))
    assigned(s)
    s.update(2, slots=1)
    s.release(0, 2)
    for uid in list(s.seats[2].inflight):
        s.release(uid, 2, bar=True)  # 70 failures queue in front of it, barred for device 2
    s.update(1, paused=False)
    for _ in range(300):
        for a in s.assign(0.0):
            s.done(a.unit, a.device)
    assert s.queued == 0 and not s.units


def test_a_unit_every_able_device_failed_is_stuck_until_unbarred() -> None:
    s = Scheduler(FAULTS)
    for d in (1, 2, 3):
        s.join(d, slots=1, seconds_per_gflop=0.1)
    s.update(3, paused=True)  # a paused device could not take it anyway
    s.add_gemm(1, units(1, 1))
    failed = []
    for _ in range(2):
        ((device, unit),) = assigned(s)
        s.release(unit, device, bar=True)
        failed.append(device)
    assert sorted(failed) == [1, 2]
    assert s.stuck() == [] and assigned(s) == []  # device 3 may take it once it resumes
    s.leave(3)
    assert s.stuck() == [0]  # every device here failed it
    s.unbar(0)
    assert s.stuck() == [] and len(assigned(s)) == 1


def test_an_owner_far_behind_or_late_loses_its_queue_to_devices_holding_none_of_its_blocks() -> None:
    """A thief holding no block of a planned unit steals it once its owner would reach it only
    after ``max_wait`` (an owner that slowed 100x), and a late lease sends its owner's queue to the
    shared queue (an owner that never answers): neither can hold a GEMM for its whole queue."""
    s = Scheduler(FAULTS)
    for d in (1, 2, 3):
        s.join(d, slots=1, seconds_per_gflop=1.0)
    s.add_gemm(7, units(7, 10, owner=1))
    assert dict(assigned(s)) == {1: 0}  # 9 s of queue at its pace: the others hold no block and wait
    s.update(1, seconds_per_gflop=100.0)  # it throttles: 900 s to reach its last unit
    s.done(0, 1)
    got = dict(assigned(s, 1.0))
    assert got[1] == 1 and {2, 3} <= set(got)  # the idle two take from its tail

    s = Scheduler(FAULTS)
    for d in (1, 2):
        s.join(d, slots=1, seconds_per_gflop=0.01)
    s.add_gemm(7, units(7, 8, owner=1))
    assert dict(assigned(s)) == {1: 0}
    late = s.expire(1.5)  # its lease passed its deadline (1.02 s), not yet twice it: it never answered
    assert [type(d).__name__ for d in late] == ["Overdue"]
    assert s.unowned == 7  # its queue went to the shared queue
    assert 2 in dict(assigned(s, 1.5))


def test_units_planned_for_a_device_whose_lease_went_late_go_to_others_until_it_answers() -> None:
    """A crashed or frozen device is found out by its heartbeat only much later; a late lease
    is the first sign. New units planned for it while it holds one go to the shared queue (or to
    a holder of their blocks), not to its queue; once its late lease ends (its result came, or
    it was taken back, a while later), it is planned for again. A heartbeat does not lift it: a
    device that beats and never answers would otherwise be planned every GEMM's units."""
    s = Scheduler(FAULTS)
    for d in (1, 2):
        s.join(d, slots=1, seconds_per_gflop=0.01)
    s.holds_block(1, "x")
    s.add_gemm(7, units(7, 1, owner=1))
    assert dict(assigned(s)) == {1: 0}
    assert [type(d).__name__ for d in s.expire(1.5)] == ["Overdue"]
    assert s.seats[1].late == 1
    s.add_gemm(8, units(8, 3, start=10, owner=1, keys=("x", "w")))  # planned for it, its block too
    assert s.unowned == 3 and s.seats[1].own_count == 0  # none queued for it, though it holds the blocks
    assert dict(assigned(s, 1.5)) == {2: 10}
    s.done(0, 1, 1.6)  # it answers after all
    assert s.seats[1].late == 0
    s.add_gemm(9, units(9, 2, start=20, owner=1))
    assert s.unowned == 2 and s.seats[1].own_count == 2  # the two left of the three before; these are its own
    assert dict(assigned(s, 1.6))[1] == 20  # its own queue first again
    # Late again and taken back at twice its deadline (it never answered): doubted for two
    # heartbeats more (a crashed device is not handed the next GEMM), then planned for again.
    assert any(isinstance(d, Overdue) and d.device == 1 for d in s.expire(3.0))
    s.add_gemm(10, units(10, 1, start=30, owner=1))
    assert s.seats[1].own_count == 0
    assert any(isinstance(d, Reclaim) and d.device == 1 for d in s.expire(60.0))
    assert s.seats[1].late == 0
    s.add_gemm(11, units(11, 1, start=40, owner=1))
    assert s.seats[1].own_count == 0
    s.expire(60.0 + DOUBT_HEARTBEATS * FAULTS.beat + 0.1)
    s.add_gemm(12, units(12, 1, start=50, owner=1))
    assert s.seats[1].own_count == 1
