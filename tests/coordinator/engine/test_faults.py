"""Leases, deadlines, heartbeats and speculation in the network-free core, on a virtual clock."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_core import Fleet, submit

from cleave.coordinator.engine import report
from cleave.coordinator.engine.core import Core
from cleave.coordinator.engine.limits import TrustPolicy
from cleave.coordinator.engine.scheduler import FaultPolicy
from cleave.coordinator.planning.tiles import GemmKind, TilingPolicy
from cleave.db.memory import MemoryStore
from cleave.wire.codes import CloseCode
from cleave.wire.messages import Cancel, Heartbeat, Result, Work

FAULTS = FaultPolicy(
    heartbeat=1.0,
    heartbeat_timeout=5.0,
    lease_floor=2.0,
    lease_factor=4.0,
    speculate_after=0.5,
    speculate_factor=2.0,
    max_copies=2,
)


@pytest.fixture
def core() -> Core:
    store = MemoryStore()
    job = store.create_job("faults", {}, 10, 0.0)
    policy = TilingPolicy(max_edge=64, min_edge=16, min_k=32, min_tile_flops=1)
    return Core(
        store,
        job,
        join_token="tok",
        rng=np.random.default_rng(0),
        policy=policy,
        faults=FAULTS,
        trust=TrustPolicy(probation_tiles=0, first_slots=8),
        band_checks=False,  # each result checked alone, as it arrives: that path is what this tests
    )


def _works(fleet: Fleet, device: int) -> list[Work]:
    return [p.message for p in fleet.pending if p.device == device]


def _answer(fleet: Fleet, device: int, tile_id: int) -> None:
    """Device computes and returns one specific tile it holds."""
    for i, item in enumerate(fleet.pending):
        if item.device == device and item.message.tile_id == tile_id:
            fleet.pending.pop(i)
            operands = item.message.operands(fleet.blocks[device])
            assert operands is not None
            fleet.route(fleet.core.handle(device, Result(tile_id, operands[0] @ operands[1], 0.001), fleet.now))
            return
    raise AssertionError(f"device {device} holds no tile {tile_id}")


def test_a_silent_device_is_dropped_after_the_heartbeat_timeout_and_its_tiles_move(core: Core) -> None:
    fleet = Fleet(core)
    frozen, alive = fleet.join("frozen"), fleet.join("alive")
    a, b = torch.randn(256, 32), torch.randn(32, 64)
    box = submit(core, fleet, a, b)
    held = set(core.devices[frozen].inflight)
    assert held
    fleet.pending = [p for p in fleet.pending if p.device != frozen]  # SIGSTOP: it never answers
    for t in range(1, 7):  # the other device keeps talking
        fleet.now = 100.0 + t
        fleet.route(core.handle(alive, Heartbeat(fleet.now), fleet.now))
        fleet.route(core.tick(fleet.now))
        fleet.drain()
    assert fleet.closed.get(frozen) == CloseCode.SILENT
    assert frozen not in core.devices
    torch.testing.assert_close(box["result"], a @ b, rtol=1e-5, atol=1e-4)
    for tile in held:
        outcomes = [lease.outcome for lease in core.store.leases(tile)]
        assert "verified" in outcomes and outcomes[0] in ("lost", "cancelled")


def test_the_coordinator_sends_heartbeats_to_quiet_devices(core: Core) -> None:
    fleet = Fleet(core)
    d = fleet.join("quiet")
    fleet.now += 1.5
    fleet.route(core.tick(fleet.now))
    assert any(isinstance(m, Heartbeat) for m in fleet.inbox[d])


def test_a_passed_deadline_sends_a_copy_and_the_first_verified_result_wins(core: Core) -> None:
    fleet = Fleet(core)
    slow = fleet.join("slow", slots=1)
    box = submit(core, fleet, torch.randn(16, 32), torch.randn(32, 16))  # one tile
    (tile,) = core.devices[slow].inflight
    fast = fleet.join("fast", slots=1)  # joins late: nothing queued is left for it
    assert not _works(fleet, fast)
    fleet.now += 1.0
    fleet.route(core.handle(slow, Heartbeat(fleet.now), fleet.now))
    fleet.route(core.tick(fleet.now))
    assert [w.tile_id for w in _works(fleet, fast)] == [tile]  # straggling: a speculative copy
    _answer(fleet, fast, tile)
    assert "result" in box
    cancels = [m for m in fleet.inbox[slow] if isinstance(m, Cancel)]
    assert cancels and cancels[0].tile_ids == (tile,)
    # The straggler's late answer is ignored quietly: no error, nothing used twice.
    out = core.handle(slow, Result(tile, torch.zeros(16, 16), 0.1), fleet.now)
    assert out == []
    assert core.handle(slow, Result(tile, torch.zeros(16, 16), 0.1), fleet.now)[0].message.code == "not_leased"
    history = [(lease.device_id, lease.issued, lease.outcome) for lease in core.store.leases(tile)]
    assert history == [(slow, "first", "cancelled"), (fast, "speculative", "verified")]
    counts = report.status(core, fleet.now)["tiles"]
    assert (counts["speculative"], counts["cancelled"]) == (1, 1)


def test_copies_wait_for_the_speculation_threshold_and_respect_max_copies(core: Core) -> None:
    fleet = Fleet(core)
    slow = fleet.join("slow", slots=1)
    submit(core, fleet, torch.randn(16, 32), torch.randn(32, 16))  # one tile
    (tile,) = core.devices[slow].inflight
    others = [fleet.join(f"idle{i}", slots=1) for i in range(3)]
    fleet.now += 0.1  # younger than speculate_after: nobody copies yet
    fleet.route(core.tick(fleet.now))
    assert not any(_works(fleet, d) for d in others)
    fleet.now += 1.0
    fleet.route(core.tick(fleet.now))
    fleet.route(core.tick(fleet.now))
    copies = [d for d in others if _works(fleet, d)]
    assert len(copies) == 1  # max_copies = 2 open leases: the original and one copy
    # The straggler's deadline (lease floor 2 s) passes: one more copy, even past max_copies.
    fleet.now = 102.5
    for d in [slow, *others]:
        fleet.route(core.handle(d, Heartbeat(fleet.now), fleet.now))
    fleet.route(core.tick(fleet.now))
    fleet.route(core.tick(fleet.now))
    holders = [d for d in [slow, *others] if tile in core.devices[d].inflight]
    assert len(holders) == 3
    assert [lease.issued for lease in core.store.leases(tile)] == ["first", "speculative", "deadline passed"]
    # At twice its deadline the straggler loses the tile: taken back, and never handed to it again.
    fleet.now = 104.5
    for d in [slow, *others]:
        fleet.route(core.handle(d, Heartbeat(fleet.now), fleet.now))
    fleet.route(core.tick(fleet.now))
    assert tile not in core.devices[slow].inflight
    first = core.store.leases(tile)[0]
    assert (first.device_id, first.outcome) == (slow, "revoked")
    cancels = [m for m in fleet.inbox[slow] if isinstance(m, Cancel)]
    assert cancels and cancels[-1].tile_ids == (tile,) and "taken back" in cancels[-1].reason
    assert report.status(core, fleet.now)["tiles"]["revoked"] >= 1


def test_deadlines_scale_with_the_device_and_its_queue(core: Core) -> None:
    fleet = Fleet(core)
    d = fleet.join("a", slots=2)
    submit(core, fleet, torch.randn(128, 32), torch.randn(32, 64))
    deadlines = sorted(core.sched.hold(t, d).soft for t in core.devices[d].inflight)
    assert all(dl >= fleet.now + FAULTS.lease_floor for dl in deadlines)
    assert deadlines[1] > deadlines[0]  # the second tile waits behind the first


def test_a_result_that_arrives_after_its_device_was_dropped_is_ignored(core: Core) -> None:
    fleet = Fleet(core)
    d1, d2 = fleet.join("a"), fleet.join("b")
    box = submit(core, fleet, torch.randn(128, 32), torch.randn(32, 64))
    tile = next(iter(core.devices[d1].inflight))
    fleet.pending = [p for p in fleet.pending if p.device != d1]
    fleet.route(core.disconnect(d1, fleet.now, "connection closed"))
    assert core.handle(d1, Result(tile, torch.zeros(64, 64)), fleet.now) == []  # a dead device says nothing
    fleet.drain()
    assert "result" in box
    assert report.status(core, fleet.now)["tiles"]["requeued"] >= 1
    row = {d["name"]: d for d in report.status(core, fleet.now)["devices"]}["a"]
    assert row["tiles_lost"] >= 1 and row["reliability"] < 1.0
    assert d2 in core.devices


def test_policy_validation() -> None:
    with pytest.raises(ValueError):
        FaultPolicy(heartbeat=5.0, heartbeat_timeout=5.0)
    with pytest.raises(ValueError):
        FaultPolicy(lease_floor=0.0)
    assert GemmKind.FORWARD.value == "fwd"


def test_a_device_over_its_memory_budget_finishes_its_tiles_before_taking_more(core: Core) -> None:
    fleet = Fleet(core)
    device = fleet.join("small-memory", slots=4, block_budget=1)
    box = submit(core, fleet, torch.randn(256, 32), torch.randn(32, 64))
    assert len(core.devices[device].inflight) == 1  # its first blocks already exceed the budget
    fleet.drain()  # still, one at a time, it gets through all of them
    assert "result" in box


def test_a_paused_device_gets_nothing_and_its_tiles_go_back(core: Core) -> None:
    from cleave.wire.messages import Pause, Resume

    fleet = Fleet(core)
    laptop = fleet.join("laptop")
    fleet.join("desktop")
    box = submit(core, fleet, torch.randn(256, 32), torch.randn(32, 64))
    held = sorted(core.devices[laptop].inflight)
    assert held
    fleet.pending = [p for p in fleet.pending if p.device != laptop]
    fleet.route(core.handle(laptop, Pause("on battery"), fleet.now))
    assert core.devices[laptop].inflight == {}
    row = {d["name"]: d for d in report.status(core, fleet.now)["devices"]}["laptop"]
    assert (row["state"], row["reason"]) == ("paused", "on battery")
    assert [lease.outcome for lease in core.store.leases(held[0])][0] == "released"
    fleet.drain()
    assert "result" in box and not any(p.device == laptop for p in fleet.pending)
    fleet.route(core.handle(laptop, Resume(), fleet.now))
    submit(core, fleet, torch.randn(256, 32), torch.randn(32, 64))
    assert core.devices[laptop].inflight  # back to work


def test_credit_reaches_busy_devices_and_a_final_tally_comes_with_finished(core: Core) -> None:
    from cleave.wire.messages import Credit, Finished

    fleet = Fleet(core)
    d = fleet.join("worker")
    submit(core, fleet, torch.randn(128, 32), torch.randn(32, 64))
    fleet.drain()
    fleet.now += 1.5
    fleet.route(core.tick(fleet.now))
    credits = [m for m in fleet.inbox[d] if isinstance(m, Credit)]
    expected = 2 * 128 * 64 * 32 / 1e9
    assert credits and abs(credits[-1].session_gflop - expected) < 1e-6 and credits[-1].total_gflop >= expected - 1e-6
    fleet.route(core.tick(fleet.now + 0.1))
    assert len([m for m in fleet.inbox[d] if isinstance(m, Credit)]) == len(credits)  # only news is sent
    out = core.finish(fleet.now + 0.2)
    assert [type(o.message) for o in out] == [Credit, Finished]


def test_a_tile_whose_compute_failed_goes_to_another_device(core: Core) -> None:
    from cleave.wire.codes import ReleaseWhy
    from cleave.wire.messages import Release

    fleet = Fleet(core)
    broken = fleet.join("broken", slots=1)
    submit(core, fleet, torch.randn(16, 32), torch.randn(32, 16))  # one tile
    (tile,) = core.devices[broken].inflight
    fleet.pending.clear()
    fleet.route(core.handle(broken, Release((tile,), ReleaseWhy.COMPUTE_FAILED, "out of memory"), fleet.now))
    assert tile not in core.devices[broken].inflight  # not straight back to it
    healthy = fleet.join("healthy", slots=1)
    assert tile in core.devices[healthy].inflight
    fleet.drain()
    assert core.store.tile_state(tile) == "verified"
