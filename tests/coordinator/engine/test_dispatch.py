"""The dispatch rules (engine/dispatch.py) that the live Core and the simulator both run.

The simulator used to keep hand copies of ``Core._dispatch``, ``_apply`` and ``_cut``, and they
drifted: its loop had no re-entry guard, and its take-back and cut were its own. Now there is one
``Dispatch``; the tests here hold each rule with a double that records what a driver is asked to
do, check that a lease taken back in a row cuts a device after the same count live and simulated,
and that the simulator keeps no copy of the loop.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any

import numpy as np
import torch
from conftest import ROOT

from cleave.coordinator.engine.conduct import Conduct, Pace, Standing
from cleave.coordinator.engine.core import Core
from cleave.coordinator.engine.dispatch import Dispatch
from cleave.coordinator.engine.limits import TrustPolicy
from cleave.coordinator.engine.profiles import Ema
from cleave.coordinator.engine.scheduler import FaultPolicy, Scheduler, UnitSpec
from cleave.coordinator.planning.tiles import GemmKind, TilingPolicy
from cleave.coordinator.whatif import simulator as sim_module
from cleave.db.memory import MemoryStore
from cleave.wire.messages import Heartbeat, Hello

FAULTS = FaultPolicy(lease_floor=1.0, lease_factor=2.0, speculate_after=1e9, speculate_factor=1e9)
TRUST = TrustPolicy(probation_tiles=0)


@dataclasses.dataclass(eq=False)
class Dev:
    id: int
    asked: int
    standing: Standing
    pace: Pace
    kept: Ema = dataclasses.field(default_factory=Ema)  # the simulator's reliability of it


class Recorder:
    """A driver's hands that note every call; ``cut_inside`` re-enters the dispatch from a cut,
    as a driver's close may."""

    def __init__(self, devices: dict[int, Dev], sched: Scheduler, *, excused: frozenset[int] = frozenset()) -> None:
        self.devices = devices
        self.sched = sched
        self.calls: list[tuple[Any, ...]] = []
        self.excused_units = set(excused)
        self.dispatch: Dispatch[Dev] | None = None

    def device(self, device_id: int) -> Dev | None:
        return self.devices.get(device_id)

    def vanished(self, device_id: int, unit: int) -> None:
        self.calls.append(("vanished", device_id, unit))

    def lease(self, dev: Dev, unit: int, now: float) -> list[Any]:
        self.calls.append(("lease", dev.id, unit))
        return [("work", dev.id, unit)]

    def flush(self, now: float) -> list[Any]:
        self.calls.append(("flush",))
        return []

    def copy(self, dev: Dev, unit: int, copy: str, now: float) -> list[Any]:
        self.calls.append(("copy", dev.id, unit))
        return [("work", dev.id, unit)]

    def excused(self, dev: Dev, unit: int) -> bool:
        return unit in self.excused_units

    def take_back(self, dev: Dev, unit: int, reason: str, excused: bool, now: float) -> list[Any]:
        self.calls.append(("take_back", dev.id, unit, excused))
        return [("cancel", dev.id, unit)]

    def on_relay(self, dev: Dev, unit: int) -> bool:
        return False

    def drop(self, dev: Dev, why: str, wait: float, on_relay: bool, now: float) -> list[Any]:
        self.calls.append(("drop", dev.id, round(wait, 3)))
        self.devices.pop(dev.id, None)
        self.sched.leave(dev.id)
        assert self.dispatch is not None
        return [("close", dev.id), *self.dispatch(now)]  # re-entered: must do nothing


def _setup(units: int, *, excused: frozenset[int] = frozenset()) -> tuple[Dispatch[Dev], Recorder, Dev]:
    sched = Scheduler(FAULTS)
    conduct = Conduct(sched, TRUST)
    dev = Dev(1, 1, Standing(TRUST.probation_tiles), Pace(1.0))
    conduct.seat(dev.id, dev.standing, dev.pace, dev.asked)
    hands = Recorder({dev.id: dev}, sched, excused=excused)
    dispatch = Dispatch(conduct, hands)
    hands.dispatch = dispatch
    sched.add_gemm(1, [UnitSpec(u, 1, f"a{u}", f"b{u}", 10**9, None) for u in range(units)])
    return dispatch, hands, dev


def test_leases_taken_back_in_a_row_cut_the_device_and_a_cut_inside_dispatch_does_not_reenter() -> None:
    dispatch, hands, dev = _setup(TRUST.cut_after + 1)
    now = 0.0
    assert dispatch(now) == [("work", 1, 0)]
    for _ in range(TRUST.cut_after):
        now += 100.0  # past twice every deadline: taken back, and the next queued unit leased
        dispatch(now)
    kinds = [c[0] for c in hands.calls]
    assert kinds.count("take_back") == TRUST.cut_after
    assert kinds.count("drop") == 1 and dev.id not in hands.devices
    assert dev.standing.cuts == 1
    # The store sees the first leases before a take-back, in order (``flush`` between them).
    first_back = kinds.index("take_back")
    assert "flush" in kinds[:first_back]
    # Nothing ran after the drop but the loop's own end: its re-entry from the drop did nothing.
    assert set(kinds[kinds.index("drop") + 1 :]) <= {"flush"}


def test_a_lease_held_waiting_on_a_relay_it_reported_counts_for_nothing() -> None:
    dispatch, hands, dev = _setup(TRUST.cut_after + 1, excused=frozenset({0, 1, 2, 3}))
    now = 0.0
    dispatch(now)
    for _ in range(TRUST.cut_after + 1):
        now += 100.0
        dispatch(now)
    backs = [c for c in hands.calls if c[0] == "take_back"]
    assert backs and all(excused for *_, excused in backs)
    assert not any(c[0] == "drop" for c in hands.calls) and dev.standing.cuts == 0


def test_the_simulator_keeps_no_copy_of_the_dispatch_loop() -> None:
    """Its module applies none of the rules the dispatch applies (a late lease, a take-back, a
    cut) itself, and a simulation dispatches through ``Dispatch`` over its own conduct rules."""
    tree = ast.parse((ROOT / "coordinator" / "whatif" / "simulator.py").read_text(encoding="utf-8"))
    rules = {"late", "taken_back", "cut"}
    own = [
        f"{node.func.attr} at line {node.lineno}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in rules
        and isinstance(node.func.value, ast.Attribute)
        and node.func.value.attr == "conduct"
    ]
    assert own == [], f"simulator.py applies dispatch rules itself: {own}"
    methods = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert not {"_apply", "_cut", "_take_back"} & methods


def test_a_device_that_never_answers_is_cut_after_the_same_take_backs_live_and_simulated() -> None:
    """The same rule, driven by both: a device that holds every lease past twice its deadline
    is cut after ``cut_after`` take-backs in a row, live (Core over a store) and simulated."""
    store = MemoryStore()
    core = Core(
        store, store.create_job("t", {}, 1, 0.0), join_token="tok", rng=np.random.default_rng(0),
        policy=TilingPolicy(max_edge=8, min_edge=8, min_tile_flops=1), faults=FAULTS, trust=TRUST, band_checks=False,
    )  # fmt: skip
    challenge = core.challenge()
    hello = Hello(token="tok", name="mute", slots=1, gflops=1.0)
    device_id, _ = core.connect(hello, challenge.nonce, 0.0)
    core.submit(torch.randn(32, 8), torch.randn(8, 8), GemmKind.PLAIN, 0.0, lambda _: None)
    now, live_backs = 0.0, 0
    while device_id in core.devices and now < 1e5:
        now += 1.0
        core.handle(device_id, Heartbeat(now), now)  # alive, and never answering
        live_reliability = core.fleet.profiles[device_id].profile().reliability
        live_backs += sum(
            1 for o in core.tick(now) if getattr(getattr(o, "message", None), "reason", "").startswith("lease taken")
        )
    assert device_id not in core.devices, "the silent device was never cut"

    sim = sim_module.Simulation.__new__(sim_module.Simulation)  # only its dispatch and its books
    sched = Scheduler(FAULTS)
    sim.sched, sim.conduct = sched, Conduct(sched, TRUST)
    sim.dispatch = Dispatch(sim.conduct, sim_module._Hands(sim))
    gone: list[int] = []
    sim.devices = {}
    sim._profiles = {}
    sim._leased, sim._arrived = {}, set()
    sim._stats = sim_module.StepStats()
    sim._lease = lambda d, uid, copy: sim._leased.__setitem__((uid, d.id), 0)  # type: ignore[method-assign]
    sim._remove = lambda d, graceful: (gone.append(d.id), sim.devices.pop(d.id), sched.leave(d.id))  # type: ignore[method-assign]
    sim._at = lambda *args: None  # type: ignore[method-assign]
    mute = Dev(7, 1, Standing(0), Pace.unproven(1.0))
    mute.alive = False  # type: ignore[attr-defined]  # no rejoin to schedule: only the cut is compared
    sim.devices[mute.id] = mute
    sim.conduct.seat(mute.id, mute.standing, mute.pace, mute.asked)
    sched.add_gemm(1, [UnitSpec(u, 1, f"a{u}", f"b{u}", 10**9, None) for u in range(16)])
    t = 0.0
    while not gone and t < 1e5:
        t += 50.0
        sim.dispatch(t)
    assert gone == [mute.id]
    assert sim._stats.reclaimed == live_backs == TRUST.cut_after
    # Each take-back counted against its reliability, live (the planner's profile) and simulated.
    assert live_reliability < 1.0 and mute.kept.seen and mute.kept.value < 1.0
