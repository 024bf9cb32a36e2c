"""The simulator: the live scheduler and planner on a virtual clock (coordinator/whatif/simulator.py).

The scheduler it drives is the live coordinator's: a recorded live run replays through a fresh
``Scheduler`` to the same decisions, and so does a recorded simulation. The rest checks what the
simulation must get right whatever the fleet: every unit verified once, bytes conserved, the
binding resource named, churn and crashes recovered from, the same seed giving the same run.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import numpy as np
import pytest

from cleave.coordinator.engine.core import Core
from cleave.coordinator.engine.limits import TrustPolicy
from cleave.coordinator.engine.live_plan import LivePlanner, Planner, batches, shared
from cleave.coordinator.engine.scheduler import Assign, FaultPolicy, Scheduler, UnitSpec
from cleave.coordinator.planning.costmodel import (
    CHECK_BATCH,
    LOOP_COSTS,
    CostModelError,
    DeviceClass,
    LoopCosts,
    Profile,
    PSProfile,
)
from cleave.coordinator.planning.planner import PlannerOptions
from cleave.coordinator.planning.tier import Tier
from cleave.coordinator.planning.tiles import GemmKind
from cleave.coordinator.planning.tiles import plan_gemm as uniform_grid
from cleave.coordinator.training.loop import TrainConfig, Trainer
from cleave.coordinator.whatif import runs
from cleave.coordinator.whatif.presets import model_shape, resolve_fleet
from cleave.coordinator.whatif.report import breakdown
from cleave.coordinator.whatif.runs import run_all
from cleave.coordinator.whatif.simulator import (
    PsWork,
    SchedulerLog,
    SimConfig,
    Simulation,
    SimulationError,
    choose_micro_batches,
    dataflow_program,
    home_seconds,
    micro_batch_choices,
    predict,
    program,
    replay,
    step_program,
)
from cleave.db.memory import MemoryStore
from tests.coordinator.engine.test_live_plan import POLICY, SLOW_PS, SMALL, CoreEngine, Fleet

# A PS that ships every GEMM (it multiplies at 1 GFLOP/s) on a 10 Gbit/s link.
SLOW = PSProfile.from_link(10, gflops={"fp32": 1.0, "bf16": 1.0, "fp16": 1.0})


def laptops(n: int) -> tuple[DeviceClass, ...]:
    return resolve_fleet("laptops", "fp32", n)


def run(**kw) -> Simulation:
    cfg = SimConfig(**{"model": model_shape("small"), "fleet": laptops(16), "ps": SLOW, "churn": False, **kw})
    sim = Simulation(cfg)
    sim.result = sim.run()
    return sim


def test_a_recorded_live_run_replays_through_the_simulators_scheduler_to_the_same_decisions() -> None:
    store = MemoryStore()
    job = store.create_job("test", {}, 10, 0.0)
    live = LivePlanner(Planner.COST, SLOW_PS, POLICY, PlannerOptions(**SMALL))
    core = Core(
        store,
        job,
        join_token="tok",
        operator_token="op",
        rng=np.random.default_rng(0),
        policy=POLICY,
        trust=TrustPolicy(probation_tiles=2, first_slots=1),
        planner=live,
    )
    log = SchedulerLog(core.sched)
    core.sched = log  # every call the live core makes, and every decision, recorded in order
    fleet = Fleet(core)
    for i, gflops in enumerate((50.0, 20.0, 5.0)):
        fleet.join(f"d{i}", gflops=gflops, slots=2)
    Trainer(TrainConfig(model="tiny", steps=2, batch_size=4, seq_len=64, seed=3), CoreEngine(core, fleet)).run()
    assigned = [e for e in log.entries if e[0] == "yield" and isinstance(e[2], Assign)]
    assert len(assigned) > 50 and len({e[2].device for e in assigned}) == 3
    sim = Simulation(SimConfig(model_shape("tiny"), laptops(3), SLOW))
    assert type(sim.sched) is type(log.inner) is Scheduler  # one class, one code path
    assert replay(log.entries, sim.sched) >= len(assigned)


def test_a_recorded_simulation_replays_to_the_same_decisions_and_only_uses_the_schedulers_calls() -> None:
    fleet = tuple(DeviceClass(c.name, c.count, dataclasses.replace(c.profile, session=30.0)) for c in laptops(12))
    cfg = SimConfig(model_shape("small"), fleet, SLOW, churn=True, seed=5, steps=2, rejoin_seconds=5.0)
    log = SchedulerLog(Scheduler(cfg.faults))
    result = Simulation(cfg, scheduler=log).run()  # type: ignore[arg-type]
    assert sum(s.leaves for s in result.steps) > 0 and sum(s.joins for s in result.steps) > 0
    assert {e[2] for e in log.entries if e[0] == "call"} <= SchedulerLog.CALLS
    assert replay(log.entries, Scheduler(cfg.faults)) > 100


def test_the_program_issues_every_gemm_of_a_step_in_the_training_loops_order() -> None:
    model = model_shape("llama2-7b")
    ops = step_program(model, 2, 128, "fp32", PSProfile())
    calls = [c for op in ops if not isinstance(op, PsWork) for c in op]
    assert len(calls) == 3 * (7 * model.n_layers + 1)  # q k v o gate up down per layer, and the head
    assert sum(c.m * c.n * c.k * 2 for c in calls) == 6 * 2 * 128 * model.linear_params()
    work = [op for op in ops if isinstance(op, PsWork)]
    assert [w.what for w in work].count("attention") == 2 * model.n_layers and work[-1].what == "optimizer"
    attention = sum(w.seconds for w in work if w.what == "attention")
    assert attention == pytest.approx(3 * model.attention_flops(2, 128) / PSProfile().flops_per_s("fp32"))
    first = [op for op in ops if not isinstance(op, PsWork)][0][0]
    assert (first.kind, first.label) == (GemmKind.FORWARD, "q.fwd")
    backward = [op for op in ops if not isinstance(op, PsWork) and len(op) == 2]
    assert [c.kind for c in backward[0]] == [GemmKind.GRAD_INPUT, GemmKind.GRAD_WEIGHT]
    assert backward[0][0].label == "head.dx" and backward[-1][0].label == "q.dx"
    # q, k and v read one X: their forward blocks share keys; dW reads the X and dY of its layer.
    q, k = calls[0], calls[1]
    assert q.a.tensor == k.a.tensor
    dw = backward[-1][1]
    assert dw.b.tensor == q.a.tensor and dw.a.transposed


def test_losing_copies_set_their_devices_back_as_the_live_coordinator_does() -> None:
    log = SchedulerLog(Scheduler())
    cfg = SimConfig(model_shape("small"), laptops(16), SLOW, churn=False)
    Simulation(cfg, scheduler=log).run()  # type: ignore[arg-type]
    calls = [e for e in log.entries if e[0] in ("call", "return")]
    # After a done() with losers, each loser is regraded (Conduct.settled, as Core calls it).
    checked = 0
    for i, entry in enumerate(calls):
        if entry[0] == "return" and isinstance(entry[2], list) and entry[2] and calls[i - 1][2] == "done":
            following = {
                e[3][0] for e in calls[i + 1 : i + 1 + 4 * len(entry[2]) + 4] if e[0] == "call" and e[2] == "update"
            }
            assert set(entry[2]) <= following, (entry, following)
            checked += 1
    assert checked > 0


def test_every_unit_is_verified_once_and_bytes_add_up() -> None:
    sim = run(steps=2)
    result = sim.result
    assert not sim.units and sim._outstanding == 0  # every unit verified, nothing left over
    steps = result.steps
    assert all(s.remote_gemms == 75 and s.local_gemms == 0 for s in steps)  # the slow PS ships everything
    assert sum(s.egress_bytes for s in steps) == pytest.approx(sum(result.device_bytes_down))
    assert sum(s.ingress_bytes for s in steps) == pytest.approx(sum(result.device_bytes_up))
    # Each GEMM's output comes up at least once.
    outputs = 2 * sum(
        4 * c.m * c.n
        for op in step_program(sim.cfg.model, 8, 256, "fp32", SLOW)
        if not isinstance(op, PsWork)
        for c in op
    )
    assert sum(s.ingress_bytes for s in steps) >= outputs
    assert all(s.seconds > 0 for s in steps) and result.step_s == steps[1].seconds


def test_the_same_seed_gives_the_same_run_and_another_seed_another_churn() -> None:
    fleet = tuple(DeviceClass(c.name, c.count, dataclasses.replace(c.profile, session=5.0)) for c in laptops(16))
    a, b, c = (run(fleet=fleet, churn=True, seed=s).result for s in (1, 1, 2))
    assert [s.seconds for s in a.steps] == [s.seconds for s in b.steps] and a.events == b.events
    assert (a.steps[0].leaves, a.steps[0].seconds) != (c.steps[0].leaves, c.steps[0].seconds)


@pytest.mark.parametrize(
    "what, ps, profile, bound",
    [
        ("a thin PS link", PSProfile.from_link(0.05, gflops={"fp32": 1.0}), {}, "ps_egress"),
        ("a slow PS CPU", dataclasses.replace(SLOW, verify_flops=2e7, unit_overhead=0.01), {}, "ps_cpu"),
        ("slow devices", SLOW, {"gflops": {"fp32": 0.3}, "down": 1e9, "up": 1e9, "rtt": 0.001}, "compute"),
        ("thin uplinks", SLOW, {"up": 3e5}, "uplink"),
    ],
)
def test_the_binding_resource_is_named(what: str, ps: PSProfile, profile: dict, bound: str) -> None:
    fleet = tuple(DeviceClass(c.name, c.count, dataclasses.replace(c.profile, **profile)) for c in laptops(8))
    # Uniform tiles: every GEMM goes out, whatever the cost model would keep home.
    sim = run(model=model_shape("small"), fleet=fleet, ps=ps, batch=2, seq=64, planner=Planner.UNIFORM)
    report = breakdown(sim.result, sim.result.step_s, ps)
    assert report["bound"] == bound, (what, report["busy_s"])


def test_a_crashed_device_costs_only_its_outstanding_units_and_is_recovered_from() -> None:
    calm = run(model=model_shape("small"), fleet=laptops(16)).result
    t = calm.steps[0].seconds
    crashed = run(model=model_shape("small"), fleet=laptops(16), fail_at=0.5 * t)
    result = crashed.result
    # The busiest device had units whose results had not reached the PS: they were redone
    # elsewhere, through their deadlines (copies) or the heartbeat timeout, whichever came first.
    assert result.injected_recovery is not None and result.injected_recovery in result.recoveries
    faults = crashed.cfg.faults
    assert 0.01 < result.injected_recovery <= faults.heartbeat_timeout + t
    assert result.steps[0].copies >= 1  # its units were copied once their deadlines passed


def test_churn_faster_than_failures_are_noticed_is_reported_as_a_stall_not_a_hang() -> None:
    # Sessions of 2 s against a 30 s heartbeat timeout: most seats are departed devices that
    # still look free, and every lease lands on one of them.
    fleet = tuple(DeviceClass(c.name, c.count, dataclasses.replace(c.profile, session=2.0)) for c in laptops(12))
    with pytest.raises(SimulationError, match="stalled"):
        run(fleet=fleet, churn=True, rejoin_seconds=0.5, seed=5, give_up=600.0)


def test_no_device_able_to_compute_and_a_ps_that_cannot_either_is_a_clear_error() -> None:
    fleet = (DeviceClass("x", 4, Profile(gflops={"fp32": 0.0}, memory=1 << 30, down=1e6, up=1e6)),)
    ps = PSProfile(gflops={"fp32": 0.0})
    with pytest.raises(SimulationError, match="can compute"):
        Simulation(SimConfig(model_shape("tiny"), fleet, ps)).run()
    with pytest.raises(SimulationError, match="positive integer"):
        SimConfig(model_shape("tiny"), fleet, SLOW, batch=0)


# --------------------------------------------------------------------------- many GEMMs in flight


def test_the_dataflow_program_runs_each_part_through_every_gemm_and_defers_only_weight_gradients() -> None:
    model = model_shape("small")
    flat = [c for op in step_program(model, 8, 128, "fp32", PSProfile()) if not isinstance(op, PsWork) for c in op]
    chains = dataflow_program(model, 8, 128, "fp32", PSProfile(), micro_batches=4)
    assert len(chains) == 4
    for part, chain in enumerate(chains):
        calls = [c for op in chain if not isinstance(op, PsWork) for c in op]
        # The same GEMMs as the whole step's, on a quarter of the tokens, no optimizer in a chain.
        assert sorted(c.label for c in calls) == sorted(c.label for c in flat)
        assert all(
            c.m * 4 == f.m or c.k * 4 == f.k
            for c, f in zip(sorted(calls, key=lambda c: c.label), sorted(flat, key=lambda c: c.label))
        )
        assert {c.label for c in calls if c.deferred} == {c.label for c in flat if c.kind is GemmKind.GRAD_WEIGHT}
        assert not any(isinstance(op, PsWork) and op.what == "optimizer" for op in chain)
        # Its activations are its own: every X and dY it reads is named for its part.
        assert all(t[1] == (0, part) for c in calls for t in (c.a.tensor, c.b.tensor) if t[0] != "W")
        # q, k and v leave together; so do their input gradients with their deferred dW.
        groups = [sorted(c.label for c in op) for op in chain if not isinstance(op, PsWork)]
        assert ["k.fwd", "q.fwd", "v.fwd"] in groups or ["qkv.fwd"] in groups
    with pytest.raises(SimulationError, match="must divide"):
        dataflow_program(model, 6, 128, "fp32", PSProfile(), micro_batches=4)


# Sixteen devices on a LAN, a PS that ships every GEMM but runs attention and AdamW itself.
LAN = (DeviceClass("lan", 16, Profile({"fp32": 50.0}, 4 << 30, 125e6, 125e6, rtt=0.01)),)
LAN_PS = PSProfile.from_link(10, gflops={"fp32": 10.0, "bf16": 10.0, "fp16": 10.0})


def test_micro_batches_in_flight_verify_every_unit_once_and_keep_the_fleet_busier() -> None:
    one = run(batch=8, seq=256, fleet=LAN, ps=LAN_PS)
    four = run(batch=8, seq=256, fleet=LAN, ps=LAN_PS, micro_batches=4, batched=True)
    for sim in (one, four):
        assert not sim.units and sim._outstanding == 0 and not sim.gemms  # all verified and assembled
        st = sim.result.steps[-1]
        assert st.remote_gemms > 0 and st.egress_bytes == pytest.approx(sum(sim.result.device_bytes_down))
    a, b = one.result.steps[-1], four.result.steps[-1]
    assert b.remote_gemms + b.local_gemms == 4 * (a.remote_gemms + a.local_gemms)
    assert b.most_gemms_in_flight > 2 >= a.most_gemms_in_flight
    assert b.gemms_in_flight > a.gemms_in_flight
    assert b.seconds < a.seconds  # stragglers and PS work overlap other parts' GEMMs
    assert b.fleet_utilisation > a.fleet_utilisation
    q = b.utilisation_quantiles
    assert 0 <= q[0.1] <= q[0.5] <= q[0.9] <= 1 and 0 < b.fleet_utilisation <= 1
    assert b.fleet_utilisation <= b.utilisation_ceiling <= 1  # no plan beats the links
    assert 0 < b.utilisation_bound <= b.utilisation_ceiling
    # The weight gradients are a third of a Linear's FLOP: what the slow devices could take alone.
    assert 0 < b.utilisation_wait_bound < b.utilisation_bound
    # The PS's verifier took results together, more than one a check: by band (the live
    # default: veterans' results wait for their row band), or batched when checked alone.
    assert b.checked >= b.units - b.copies and b.checks + b.bands < b.checked
    assert b.checks * CHECK_BATCH >= b.alone  # no batch larger than the live verifier's
    # The forecast is the cost model's, made before the step: within 25% of the simulated step.
    assert b.forecast == pytest.approx(b.seconds, rel=0.25)
    assert not b.kept_home and b.home > b.seconds


@pytest.mark.parametrize("gflops", [10.0, 60.0, 1e5])
def test_the_forecast_never_ships_a_step_the_coordinator_alone_runs_faster(gflops: float) -> None:
    ps = PSProfile.from_link(10, gflops={"fp32": gflops, "bf16": gflops, "fp16": gflops})
    st = run(fleet=LAN, ps=ps, micro_batches=2, batched=True).result.steps[-1]
    assert st.forecast <= st.home * (1 + 1e-9)


def test_a_step_forecast_faster_at_home_keeps_every_gemm_home(monkeypatch: pytest.MonkeyPatch) -> None:
    import cleave.coordinator.whatif.simulator as simulator

    calls = iter([1e-3, math.inf])  # the first step: the PS alone is faster than any plan; the second: not
    monkeypatch.setattr(simulator, "home_seconds", lambda *args: next(calls))
    home, shipped = run(fleet=LAN, ps=LAN_PS, micro_batches=2, batched=True, steps=2).result.steps
    assert home.kept_home and home.remote_gemms == 0 and home.local_gemms > 0 and home.forecast == 1e-3
    # The decision is the step's: the next one plans on its lanes again and ships.
    assert not shipped.kept_home and shipped.remote_gemms > 0


def test_micro_batch_choices_are_the_batchs_divisors_up_to_the_parts_the_trainer_runs_at_once() -> None:
    assert micro_batch_choices(64) == [1, 2, 4, 8]
    assert micro_batch_choices(12) == [1, 2, 3, 4, 6]
    assert micro_batch_choices(7) == [1, 7]
    assert micro_batch_choices(1) == [1]


def test_auto_micro_batches_take_the_fewest_parts_within_the_slack_of_the_best_forecast() -> None:
    from cleave.coordinator.whatif.simulator import MICRO_BATCH_SLACK

    model = model_shape("small")
    members = {i + 1: cls.profile for i, cls in enumerate(c for c in LAN for _ in range(c.count))}  # 16 devices
    for planner in (Planner.COST, Planner.UNIFORM):
        choice = choose_micro_batches(model, 8, 256, "fp32", LAN_PS, planner, POLICY, members)
        assert set(choice.forecasts) == {1, 2, 4, 8}
        # Each forecast is predict's for that many lanes (the PS alone where sooner, with COST).
        for m, forecast in choice.forecasts.items():
            chains, tail = program(model, 8, 256, "fp32", LAN_PS, 0, m)
            want = predict(chains, tail, LivePlanner(planner, LAN_PS, POLICY, lanes=m), "fp32", members)
            home = home_seconds(chains, tail, LAN_PS, "fp32")
            assert forecast == (min(want, home) if planner is Planner.COST else want)
        best = min(choice.forecasts.values())
        assert choice.forecasts[choice.micro_batches] <= best * (1 + MICRO_BATCH_SLACK)
        assert all(f > best * (1 + MICRO_BATCH_SLACK) for m, f in choice.forecasts.items() if m < choice.micro_batches)
        assert f"micro-batches: {choice.micro_batches}" in choice.summary()
    # On this LAN fleet parts side by side do pay (test_micro_batches_in_flight...): auto takes more than one.
    assert choose_micro_batches(model, 8, 256, "fp32", LAN_PS, Planner.COST, POLICY, members).micro_batches > 1
    # A PS that outruns the fleet keeps every step home: parts change nothing, so one part.
    fast = PSProfile.from_link(10, gflops={"fp32": 1e6, "bf16": 1e6, "fp16": 1e6})
    assert choose_micro_batches(model, 8, 256, "fp32", fast, Planner.COST, POLICY, members).micro_batches == 1
    # The live coordinator never keeps a whole step home (it decides GEMM by GEMM): its forecasts
    # are the lanes' own, never the PS alone's.
    live = choose_micro_batches(model, 8, 256, "fp32", LAN_PS, Planner.COST, POLICY, members, keeps_home=False)
    for m, forecast in live.forecasts.items():
        chains, tail = program(model, 8, 256, "fp32", LAN_PS, 0, m)
        assert forecast == predict(chains, tail, LivePlanner(Planner.COST, LAN_PS, POLICY, lanes=m), "fp32", members)
    # No more parts than devices: two devices weigh one and two parts only.
    two = {d: members[d] for d in (1, 2)}
    assert set(choose_micro_batches(model, 8, 256, "fp32", LAN_PS, Planner.COST, POLICY, two).forecasts) == {1, 2}
    assert choose_micro_batches(model, 8, 256, "fp32", LAN_PS, Planner.COST, POLICY, {}).micro_batches == 1


def test_a_simulation_asked_for_auto_micro_batches_runs_the_cost_models_choice() -> None:
    sim = run(batch=8, seq=256, fleet=LAN, ps=LAN_PS, micro_batches=0, batched=True)
    res = sim.result
    assert res.choice is not None and res.micro_batches == res.choice.micro_batches > 1
    st = res.steps[-1]
    # The step ran as chosen: as many parts' GEMMs, forecast as the choice forecast it.
    assert st.forecast == pytest.approx(res.choice.forecasts[res.micro_batches])
    assert st.remote_gemms + st.local_gemms == res.micro_batches * len(
        [
            c
            for op in step_program(model_shape("small"), 8, 256, "fp32", LAN_PS)
            if not isinstance(op, PsWork)
            for c in op
        ]
    )
    with pytest.raises(SimulationError, match="micro_batches"):
        SimConfig(model_shape("small"), LAN, LAN_PS, micro_batches=-1)


def test_lanes_share_each_class_out_and_the_ps_among_them() -> None:
    profiles = {d: Profile({"fp32": 100.0}, 1 << 30, 1e7, 1e6) for d in range(10)}
    profiles |= {d: Profile({"fp32": 1000.0}, 1 << 30, 1e8, 1e7) for d in range(10, 13)}
    planner = LivePlanner(Planner.COST, PSProfile(), POLICY, lanes=4)
    seen: list[set[int]] = []
    for _ in range(4):
        live = planner.plan(4096, 1024, 1024, GemmKind.FORWARD, "fp32", profiles, 1, now=0.0)
        assert live.done_at is not None and live.done_at > 0
        seen.append(set(live.owners.values()))
    assert all(a.isdisjoint(b) for i, a in enumerate(seen) for b in seen[i + 1 :])  # no device in two lanes
    assert set().union(*seen) <= set(profiles)
    with pytest.raises(CostModelError, match="lanes"):
        LivePlanner(Planner.COST, PSProfile(), POLICY, lanes=0)
    half = shared(PSProfile(), 2)
    assert half.egress == PSProfile().egress / 2 and half.unit_overhead == 2 * PSProfile().unit_overhead


def test_a_batch_holds_one_owners_tiles_and_every_tile_goes_out_once() -> None:
    tiles = uniform_grid(4096, 4096, 512, GemmKind.FORWARD, 8, POLICY).tiles
    owners = {t.index: t.index % 3 for t in tiles if t.index % 5}  # some tiles have no owner
    out = batches(tiles, owners, limit=4)
    assert sorted(t.index for b in out for t in b) == [t.index for t in tiles]
    for b in out:
        assert len({owners.get(t.index) for t in b}) == 1 and len(b) <= 4
        if owners.get(b[0].index) is None:
            assert len(b) == 1
    mine = [b for b in out if owners.get(b[0].index) == 0]
    assert len(mine) >= 2  # at least two messages per owner: it downloads one while computing the other


def test_a_tier_simulates_its_slowest_coordinator_with_the_collectives_on_its_trainer() -> None:
    """Two coordinators: the run is one of them with half the batch, the fewer of each class's
    devices, and after the step's GEMMs the reduce-scatter, AdamW on half the parameters and
    the all-gather, priced by the tier's formula, on the trainer thread."""
    model = model_shape("small")
    tier = Tier.from_gbps(2, 10)
    chains, tail = program(model, 4, 256, "fp32", LAN_PS, 0, 1, tier)
    assert not any(isinstance(op, PsWork) and op.what == "optimizer" for op in chains[0])
    assert [op.what for op in tail] == ["tier", "optimizer", "tier"]
    sizes = model.parameter_sizes()
    assert tail[0].seconds == pytest.approx(tier.reduce_seconds(sizes, LAN_PS.memory_bw))
    assert tail[2].seconds == pytest.approx(tier.gather_seconds(sizes))
    (whole,) = program(model, 8, 256, "fp32", LAN_PS, 0, 2)[1]
    share = tier.optimizer_share(sizes) / model.params  # the busiest rank's, whole parameters
    assert 0.5 <= share < 0.55
    assert tail[1].seconds == pytest.approx(whole.seconds * share, rel=1e-6)
    fleet = (DeviceClass("a", 5, LAN[0].profile), DeviceClass("b", 3, LAN[0].profile))
    sim = run(batch=8, seq=256, fleet=fleet, ps=LAN_PS, tier=tier, micro_batches=2)
    st = sim.result.steps[-1]
    assert sim.result.devices == 2 + 1  # 5 // 2 + 3 // 2: the rank dealt the fewest
    assert st.ps_cpu["tier"] == pytest.approx(tail[0].seconds + tail[2].seconds)
    assert st.remote_gemms > 0 and not sim.units  # its slice's GEMMs shipped and verified
    share = (DeviceClass("a", 2, LAN[0].profile), DeviceClass("b", 1, LAN[0].profile))
    solo = run(batch=4, seq=256, fleet=share, ps=LAN_PS, micro_batches=2)
    # The same slice on the same devices, plus the tier's collectives and less AdamW.
    assert st.seconds == pytest.approx(
        solo.result.steps[-1].seconds + st.ps_cpu["tier"] - (whole.seconds - tail[1].seconds), rel=0.1
    )
    with pytest.raises(SimulationError, match="does not cut into 3 equal slices"):
        SimConfig(model, fleet, LAN_PS, batch=8, tier=Tier.from_gbps(3, 10))
    with pytest.raises(SimulationError, match="leave the slowest of them no devices"):
        SimConfig(model, fleet, LAN_PS, batch=8, tier=Tier.from_gbps(8, 10))
    with pytest.raises(SimulationError, match="each rank's slice of the batch"):
        SimConfig(model, fleet, LAN_PS, batch=8, micro_batches=8, tier=tier)


def test_relays_send_each_block_from_the_ps_once_per_relay_and_serve_every_device() -> None:
    """Behind relays the PS sends a block at most once per relay (what it lacks), the relays
    carry every byte the devices download, and a PS whose egress binds gets a shorter step.
    Without relays every byte a device downloads leaves the PS."""
    narrow = dataclasses.replace(SLOW, egress=SLOW.egress / 40)  # 250 Mbit/s: the PS's link binds
    alone = run(ps=narrow, planner=Planner.UNIFORM)
    plain = alone.result.steps[0]
    one = run(ps=dataclasses.replace(narrow, relays=1), planner=Planner.UNIFORM)
    relayed = one.result.steps[0]
    assert plain.relay_bytes == 0 and plain.egress_bytes == pytest.approx(sum(alone.result.device_bytes_down))
    assert relayed.relay_bytes == pytest.approx(sum(one.result.device_bytes_down))  # every device byte via the relay
    # Each distinct block once: the step's GEMM operands, at most (the relay's cache holds them all).
    operands = sum(
        4 * (c.m * c.k + c.k * c.n)
        for op in step_program(one.cfg.model, 8, 256, "fp32", SLOW)
        if not isinstance(op, PsWork)
        for c in op
    )
    assert relayed.egress_bytes <= operands
    assert relayed.egress_bytes < 0.5 * plain.egress_bytes
    assert relayed.seconds < plain.seconds
    # A relay that caches almost nothing fetches a block again for each device that needs it.
    tiny_cache = run(ps=dataclasses.replace(narrow, relays=1, relay_memory=1.0), planner=Planner.UNIFORM)
    assert tiny_cache.result.steps[0].egress_bytes > relayed.egress_bytes


def test_the_cost_model_prices_a_relayed_block_once_from_the_ps_and_once_per_device_from_the_relay() -> None:
    ps = PSProfile(egress=1e9, relays=0)
    assert ps.send_seconds(8e9, 1e9) == pytest.approx(8.0)
    relayed = dataclasses.replace(ps, relays=2, relay_egress=4e9)
    # The PS sends each distinct block once per relay (2 GB); the relays carry all 8 GB at 8 GB/s.
    assert relayed.send_seconds(8e9, 1e9) == pytest.approx(max(2.0, 1.0))
    # Never more from the PS than without relays; slow relays bind on their own egress.
    assert dataclasses.replace(ps, relays=16).send_seconds(1e9, 1e9) == pytest.approx(1.0)
    assert dataclasses.replace(ps, relays=1, relay_egress=1e8).send_seconds(8e9, 1e9) == pytest.approx(80.0)
    with pytest.raises(CostModelError):
        PSProfile(relays=-1)


# --------------------------------------------------------------------------- the coordinator's own resources


LAN_FLEET = (DeviceClass("lan", 8, Profile({"fp32": 50.0}, 4 << 30, 125e6, 125e6, rtt=0.01)),)


def test_a_costly_event_loop_binds_the_step_and_the_report_names_it() -> None:
    # Bytes per FLOP huge for the loop: every byte it frames costs 1 us (1 MB/s), far below the
    # link and the devices: the step is as long as the loop's work, and the report says so.
    slow_loop = dataclasses.replace(LAN_PS, loop=LoopCosts(1e-3, 1e-3, 1e-6, 1e-6))
    kw = {"model": model_shape("tiny"), "fleet": LAN_FLEET, "batch": 2, "seq": 64, "planner": Planner.UNIFORM}
    free = run(ps=dataclasses.replace(LAN_PS, loop=LoopCosts(0.0, 0.0, 0.0, 0.0)), **kw).result.steps[-1]
    bound = run(ps=slow_loop, **kw).result.steps[-1]
    assert free.loop_s == 0 and free.busiest != "loop"
    assert bound.busiest == "loop" and bound.ps_shares["loop"] > 0.9
    expected = slow_loop.loop.seconds(2 * bound.units, bound.units, bound.egress_bytes, bound.ingress_bytes)
    assert bound.loop_s == pytest.approx(expected, rel=0.05)  # each lease framed, each result read
    # (The loop's queue can outlast the step by a copy's frame: copies of late units are framed too.)
    assert bound.seconds >= 0.9 * bound.loop_s and bound.loop_s > 5 * free.seconds
    report = breakdown(Simulation(SimConfig(ps=slow_loop, churn=False, **kw)).run(), bound.seconds, slow_loop)
    assert report["coordinator_busiest"] == "loop" and report["coordinator_share"]["loop"] > 0.9
    # Two workers share the loop's work: each is busy about half as long.
    two = run(ps=dataclasses.replace(slow_loop, workers=2), **kw).result.steps[-1]
    assert two.ps_busy["loop"] == pytest.approx(two.loop_s / 2) and two.seconds < 0.7 * bound.seconds


def test_a_lease_waiting_for_the_busy_loop_is_neither_late_nor_copied() -> None:
    # The loop frames each tile's 10 us a byte (about 50 s of frames for the step): leases are
    # decided at once, but a frame leaves only when the loop gets to it. Counting the deadline
    # from the lease, every lease expired before its frame left, each copy queued behind the
    # loop too, and leases were taken back twice over: the run stalled ("no unit verified in
    # 120 simulated seconds"). Deadlines count from the frame on the wire (Scheduler.on_wire)
    # and stop while a result waits for the loop (Scheduler.result_in), as the live loop, which
    # decides a lease when it gets to it, counts them.
    kw = {"model": model_shape("tiny"), "fleet": LAN_FLEET, "batch": 2, "seq": 64, "planner": Planner.UNIFORM}
    ps = dataclasses.replace(LAN_PS, loop=LoopCosts(1e-3, 1e-3, 1e-5, 1e-5))
    st = run(ps=ps, give_up=120.0, **kw).result.steps[-1]
    assert st.copies == 0 and st.reclaimed == 0 and st.units == st.checked
    assert st.busiest == "loop" and st.seconds == pytest.approx(st.loop_s, rel=0.1)


def test_devices_sharing_one_process_take_their_turns_in_it() -> None:
    # bench_sim_live.py: bench_tax's clients replay in one process; each unit takes host_cpu of it.
    kw = {"model": model_shape("tiny"), "fleet": LAN_FLEET, "batch": 2, "seq": 64, "planner": Planner.UNIFORM}
    free = run(**kw).result.steps[-1]
    shared = run(host_cpu=0.5, **kw).result.steps[-1]
    assert shared.seconds >= 0.5 * shared.checked > free.seconds  # one unit at a time, whatever the fleet
    with pytest.raises(SimulationError, match="host_cpu"):
        SimConfig(host_cpu=-1.0, ps=LAN_PS, **kw)


def test_the_scheduler_counts_a_lease_from_its_frame_on_the_wire() -> None:
    sched = Scheduler(FaultPolicy(lease_floor=2.0))
    sched.join(1, slots=1, seconds_per_gflop=1.0)
    sched.add_gemm(0, [UnitSpec(7, 0, "a", "b", flops=10**9)])
    assert [d.unit for d in sched.assign(0.0)] == [7]
    hold = sched.hold(7, 1)
    window = hold.soft - hold.leased_at
    sched.on_wire(7, 1, 30.0)  # the frame waited 30 s for the loop
    assert hold.leased_at == 30.0 and hold.soft == pytest.approx(30.0 + window)
    assert sched.expire(29.0 + window) == []  # the old deadline passed: not late
    sched.result_in(7, 1, 31.0, 100.0)  # its result waits 69 s for the loop to read it
    assert sched.expire(99.0) == []
    assert [type(d).__name__ for d in sched.expire(100.0 + window)] == ["Overdue"]


def test_band_checks_cost_the_verifier_less_than_checking_each_result() -> None:
    kw = {"model": model_shape("tiny"), "fleet": LAN_FLEET, "batch": 2, "seq": 64, "planner": Planner.UNIFORM}
    bands = run(band_checks=True, **kw).result.steps[-1]
    alone = run(band_checks=False, **kw).result.steps[-1]
    assert bands.bands > 0 and bands.alone == 0  # veterans: every result waits for its band
    assert alone.bands == 0 and alone.alone == alone.checked
    assert bands.checked == alone.checked
    assert bands.ps_cpu["verify"] < alone.ps_cpu["verify"]
    # Newcomers are on probation: their results are checked alone until it ends.
    fresh = run(band_checks=True, veterans=False, **kw).result.steps[0]
    assert fresh.alone > 0


def test_the_loop_s_costs_come_from_one_place() -> None:
    # The simulator, the planner (through PSProfile) and the calibration read LOOP_COSTS.
    assert PSProfile().loop is LOOP_COSTS and LAN_PS.loop is LOOP_COSTS
    assert shared(LAN_PS, 4).loop == LOOP_COSTS.scaled(4)


def test_devices_the_step_leaves_idle_sleep_after_the_standby_policys_wait_and_never_while_working() -> None:
    """``class_standby_s``: a device with no work in the step sleeps once ``after`` seconds have
    passed; one that worked sleeps only ``after`` past its last result; ``after`` 0 never."""
    from cleave.coordinator.engine.standby import StandbyPolicy

    fleet, tiny = laptops(16), model_shape("tiny")
    sim = run(model=tiny, fleet=fleet, standby=StandbyPolicy(after=1.0))
    st = sim.result.steps[-1]
    for name, asleep in st.class_standby_s.items():
        awake = st.class_present_s[name] - st.class_busy_s[name]
        assert 0 <= asleep <= awake + 1e-9  # never asleep while computing
    idle = [d for d in sim.devices.values() if d.compute_s == 0]
    bound = sum(max(0.0, st.seconds - 1.0) for _ in idle)
    assert sum(st.class_standby_s.values()) >= bound - 1e-6  # the idle ones slept after 1 s
    assert idle and st.devices_used  # some computed, some did not
    never = run(model=tiny, fleet=fleet, standby=StandbyPolicy(after=0.0)).result.steps[-1]
    assert sum(never.class_standby_s.values()) == 0


def test_a_long_simulation_tells_how_far_it_has_got(monkeypatch: pytest.MonkeyPatch) -> None:
    """``tell``: a line every ``TELL_EVERY`` events with the ops done of the step's and the
    simulated clock, never more done than there are, the clock never going back."""
    import cleave.coordinator.whatif.simulator as simulator

    monkeypatch.setattr(simulator, "TELL_EVERY", 50)
    lines: list[str] = []
    cfg = SimConfig(model_shape("tiny"), laptops(16), SLOW, churn=False)
    Simulation(cfg, tell=lines.append).run()
    assert len(lines) >= 3
    parsed = [tuple(float(x.replace(",", "")) for x in (w[0], w[2], w[4])) for w in (line.split() for line in lines)]
    assert all(0 <= done <= total for done, total, _ in parsed)
    assert [t for *_, t in parsed] == sorted(t for *_, t in parsed)


def test_a_crash_halfway_through_the_steps_gemms_needs_no_calm_run_first() -> None:
    # fail_share: the crash lands once half the last step's GEMMs are submitted, mid-step
    # whatever the step takes, so cleave simulate's two runs can go side by side.
    calm = run(model=model_shape("small"), fleet=laptops(16)).result
    crashed = run(model=model_shape("small"), fleet=laptops(16), fail_share=0.5).result
    assert crashed.injected_recovery is not None and crashed.injected_recovery in crashed.recoveries
    assert crashed.steps[0].seconds >= calm.steps[0].seconds
    # Over two steps, only the last one's.
    two = run(model=model_shape("small"), fleet=laptops(16), fail_share=0.5, steps=2).result
    assert two.injected_recovery is not None and two.steps[1].seconds >= calm.steps[0].seconds
    with pytest.raises(SimulationError, match="fail_share"):
        run(fail_share=0.0)
    with pytest.raises(SimulationError, match="fail_share"):
        run(fail_share=0.5, fail_at=1.0)


def test_runs_side_by_side_in_processes_give_what_one_process_gives_in_order() -> None:
    base = SimConfig(model_shape("small"), laptops(16), SLOW, churn=False)
    configs = [base, dataclasses.replace(base, fail_share=0.5), dataclasses.replace(base, seed=3, churn=True)]
    lines: list[tuple[int, str]] = []
    apart = run_all(configs, lambda i, line: lines.append((i, line)), processes=2)
    here = run_all(configs, processes=1)
    assert [r.steps[0].seconds for r in apart] == [r.steps[0].seconds for r in here]
    assert [r.events for r in apart] == [r.events for r in here]
    assert apart[1].injected_recovery == here[1].injected_recovery is not None
    # A child's error reaches the caller as the same error, not a hang.
    mute = (DeviceClass("x", 4, Profile(gflops={"fp32": 0.0}, memory=1 << 30, down=1e6, up=1e6)),)
    broken = SimConfig(model_shape("tiny"), mute, PSProfile(gflops={"fp32": 0.0}))
    with pytest.raises(SimulationError, match="can compute"):
        run_all([base, broken], processes=2)
    with pytest.raises(SimulationError, match="processes"):
        run_all([base], processes=0)


@pytest.mark.skipif(sys.platform != "linux", reason="the child must inherit the patch: forked on Linux only")
def test_a_child_run_that_dies_is_an_error_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    real = runs._run

    def dies_aside(cfg: SimConfig, index: int, tell: object) -> object:
        if index == 1:
            os._exit(3)  # killed, say, by the kernel for memory: no result, no error sent
        return real(cfg, index, tell)

    monkeypatch.setattr(runs, "_run", dies_aside)
    base = SimConfig(model_shape("small"), laptops(16), SLOW, churn=False)
    with pytest.raises(SimulationError, match=r"died \(exit code 3\)"):
        run_all([base, base], processes=2)
