"""The cost planner on the live coordinator: classes from measured profiles, plans mapped to
tiles and devices, and exactness with every partition kind forced (GEMMs and whole training
runs against plain torch)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from cleave.coordinator.engine import report
from cleave.coordinator.engine.core import Core
from cleave.coordinator.engine.limits import TrustPolicy
from cleave.coordinator.engine.live_plan import HOME_MARGIN, LIVE_KINDS, LivePlanner, Planner, fleet_classes
from cleave.coordinator.engine.outbound import Limit, Outbound, Send
from cleave.coordinator.planning.costmodel import Profile, PSProfile
from cleave.coordinator.planning.planner import Kind, PlannerOptions
from cleave.coordinator.planning.tiles import GemmKind, TilingPolicy
from cleave.coordinator.training.linear import GemmRequest, LocalEngine
from cleave.coordinator.training.loop import TrainConfig, Trainer
from cleave.db.memory import MemoryStore
from cleave.wire.messages import MAX_PAIRS, Hello, Result, Work, decode, encode

POLICY = TilingPolicy(max_edge=64, min_edge=16, min_k=32, min_tile_flops=1)
# Small options so that every kind has candidates on small matrices.
SMALL = dict(edges=(16, 32, 64), pieces=(32, 64), slabs=(2,), uniform=POLICY, local_sum=False)
# A PS much slower than the devices, so that shipping wins unless the kind forces the PS.
SLOW_PS = PSProfile(gflops={"fp32": 0.01}, verify_flops=1e12, unit_overhead=0.0)


class Fleet:
    """Honest in-process devices speaking the real messages to a Core."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.blocks: dict[int, dict[str, torch.Tensor]] = {}
        self.pending: list[Send] = []
        self.now = 100.0
        self.computed: dict[int, int] = {}
        self.summed = 0  # work messages with more than one pair of blocks

    def join(self, name: str, gflops: float = 50.0, slots: int = 4) -> int:
        nonce = self.core.gate.challenge().nonce
        device, out = self.core.connect(Hello(token="tok", name=name, slots=slots, gflops=gflops), nonce, self.now)
        self.blocks[device] = {}
        self.route(out)
        return device

    def route(self, out: list[Outbound]) -> None:
        for item in out:
            if isinstance(item, Limit) or not isinstance(item, Send):
                continue
            if isinstance(item.message, Work):
                # Through the real codec: a frame a client could not decode fails here.
                item = Send(item.device, decode(encode(item.message)))
                for g in item.message.forget:
                    self.blocks[item.device] = {
                        k: v for k, v in self.blocks[item.device].items() if not k.startswith(f"{g}.")
                    }
                for blk in item.message.blocks:
                    self.blocks[item.device][blk.key] = blk.data
                self.pending.append(item)

    def drain(self) -> None:
        while self.pending:
            item = self.pending.pop(0)
            work = item.message
            a, b = work.operands(self.blocks[item.device])
            self.summed += bool(work.more)
            self.now += 0.001
            self.computed[item.device] = self.computed.get(item.device, 0) + 1
            self.route(self.core.handle(item.device, Result(work.tile_id, a @ b, 0.0005, 0.0), self.now))


class CoreEngine:
    """The trainer's MatmulEngine, through a Core and honest in-process devices."""

    def __init__(self, core: Core, fleet: Fleet) -> None:
        self.core, self.fleet = core, fleet
        self.step = 0

    def begin_step(self, step: int) -> None:
        self.core.begin_step(step, self.fleet.now)

    def run(self, requests: Sequence[GemmRequest]) -> list[torch.Tensor]:
        box: dict[int, torch.Tensor] = {}
        for i, r in enumerate(requests):
            _, out = self.core.submit(r.a, r.b, r.kind, self.fleet.now, lambda c, i=i: box.__setitem__(i, c))
            self.fleet.route(out)
        self.fleet.drain()
        assert len(box) == len(requests), "a GEMM never finished"
        return [box[i] for i in range(len(requests))]


def make_core(kinds: frozenset[Kind] | None, planner: Planner = Planner.COST, local_sum: bool = False) -> Core:
    store = MemoryStore()
    job = store.create_job("test", {}, 10, 0.0)
    options = PlannerOptions(kinds=kinds or LIVE_KINDS, **{**SMALL, "local_sum": local_sum})
    live = LivePlanner(planner, SLOW_PS, POLICY, options)
    return Core(
        store,
        job,
        join_token="tok",
        operator_token="op",
        rng=np.random.default_rng(0),
        policy=POLICY,
        trust=TrustPolicy(probation_tiles=0, first_slots=8),
        planner=live,
        band_checks=False,  # each result checked alone, as it arrives: that path is what this tests
    )


def test_devices_with_similar_profiles_share_a_class_priced_at_the_weakest() -> None:
    def prof(gflops: float, down: float) -> Profile:
        return Profile(gflops={"fp32": gflops}, memory=1 << 30, down=down, up=1e6)

    classes, members = fleet_classes({1: prof(100, 1e7), 2: prof(110, 1.1e7), 3: prof(10, 1e7)}, "fp32")
    assert sorted(len(ids) for ids in members.values()) == [1, 2]
    pair = next(c for c in classes if c.count == 2)
    assert pair.profile.gflops["fp32"] <= 100 and pair.profile.down <= 1e7  # never better than measured


@pytest.mark.parametrize("kind", [Kind.OUTPUT, Kind.SPLIT_K, "split-k-sum", Kind.GRID3D, Kind.LOCAL])
@pytest.mark.parametrize("gemm", [GemmKind.FORWARD, GemmKind.GRAD_WEIGHT, GemmKind.PLAIN])
def test_every_partition_kind_gives_the_product(kind: Kind | str, gemm: GemmKind) -> None:
    summed = kind == "split-k-sum"  # a device adds up its own pieces (work with several pairs)
    kind = Kind.SPLIT_K if summed else kind
    core = make_core(frozenset({kind}), local_sum=summed)
    fleet = Fleet(core)
    for i in range(4):
        fleet.join(f"d{i}")
    torch.manual_seed(0)
    a, b = torch.randn(192, 256), torch.randn(256, 160)
    box: dict = {}
    _, out = core.submit(a, b, gemm, fleet.now, lambda c: box.setdefault("c", c))
    fleet.route(out)
    fleet.drain()
    used = core.prediction.kinds
    if used == {"uniform": 1}:  # this kind has no plan for this GEMM: the fixed grid is used
        assert not (kind is Kind.OUTPUT and gemm is not GemmKind.GRAD_WEIGHT), "output tiles always fit"
    else:
        assert used == {kind.value: 1} or (summed and used == {"split-k summed": 1}), used
    # Reduction split in pieces: sums in another order, so float32 rounding (|c| ~ 16 here).
    torch.testing.assert_close(box["c"], a @ b, rtol=1e-5, atol=1e-4)
    if kind is Kind.LOCAL:
        assert not fleet.computed  # the PS kept it
    if summed and gemm is GemmKind.FORWARD:
        assert fleet.summed, "some device added up several pieces of one unit"


def test_a_fast_device_is_planned_more_tiles_and_each_device_starts_on_its_own() -> None:
    fast_link = dict(memory=1 << 30, down=1e9, up=1e9, rtt=0.0)
    profiles = {1: Profile(gflops={"fp32": 400.0}, **fast_link), 2: Profile(gflops={"fp32": 25.0}, **fast_link)}
    live = LivePlanner(Planner.COST, SLOW_PS, POLICY, PlannerOptions(kinds=frozenset({Kind.OUTPUT}), **SMALL))
    plan = live.plan(256, 256, 4096, GemmKind.FORWARD, "fp32", profiles)
    counts = {d: sum(1 for owner in plan.owners.values() if owner == d) for d in (1, 2)}
    assert counts[1] >= 3 * counts[2] and counts[1] + counts[2] == len(plan.tiles.tiles)

    core = make_core(frozenset({Kind.OUTPUT}))
    fleet = Fleet(core)
    for name in ("a", "b"):
        fleet.join(name)
    live_plan = core.fleet.plan(core.planner, 256, 256, 512, GemmKind.FORWARD, 0.0)
    _, out = core.submit(torch.randn(256, 512), torch.randn(512, 256), GemmKind.FORWARD, fleet.now, lambda c: None)
    first = [item for item in out if isinstance(item, Send) and isinstance(item.message, Work)]
    tiles = core.gemms[next(iter(core.gemms))].tiles
    assert first and all(live_plan.owners[tiles[item.message.tile_id].index] == item.device for item in first)


CFG = dict(model="tiny", steps=3, batch_size=4, seq_len=64, seed=3)


@pytest.fixture(scope="module")
def local_losses() -> list[float]:
    return [r.loss for r in Trainer(TrainConfig(**CFG), LocalEngine()).run()]


@pytest.mark.parametrize(
    "kinds",
    [
        None,
        frozenset({Kind.OUTPUT}),
        frozenset({Kind.SPLIT_K}),
        "split-k-sum",
        frozenset({Kind.GRID3D}),
        frozenset({Kind.LOCAL}),
        "uniform",
    ],
    ids=["cost", "output", "split-k", "split-k-sum", "3d", "local", "uniform"],
)
def test_training_with_each_partition_equals_local_torch(kinds, local_losses: list[float]) -> None:
    summed = kinds == "split-k-sum"
    if kinds == "uniform":
        core = make_core(None, Planner.UNIFORM)
    elif summed:
        kinds = frozenset({Kind.SPLIT_K})
        core = make_core(kinds, local_sum=True)
    else:
        core = make_core(kinds)
    fleet = Fleet(core)
    for i in range(3):
        fleet.join(f"d{i}")
    losses = [r.loss for r in Trainer(TrainConfig(**CFG), CoreEngine(core, fleet)).run()]
    for got, want in zip(losses, local_losses):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, local_losses)
    if summed:
        assert fleet.summed, "devices added up their own pieces"

    status = report.status(core, fleet.now)["plan"]
    if kinds not in (None, "uniform"):
        (kind,) = kinds
        ran = status["partitions"].get(kind.value, 0) + status["partitions"].get(f"{kind.value} summed", 0)
        assert ran > 0, status  # the forced kind really ran
    assert status["measured_step_s"] is not None
    if kinds in (None, "uniform"):  # a forced kind falls back to the fixed grid where it has no plan
        assert status["predicted_gemm_s"] is not None and status["predicted_step_s"] is not None
    assert status["predicted_home_step_s"] is not None  # the coordinator alone, beside the plan
    if kinds is None:  # the cost planner weighs keeping each GEMM home: never a slower plan
        assert status["predicted_step_s"] <= status["predicted_home_step_s"] + 1e-4, status


def test_long_runs_of_pieces_go_as_several_units_that_fit_a_frame() -> None:
    core = make_core(frozenset({Kind.SPLIT_K}), local_sum=True)
    core.planner.options = PlannerOptions(kinds=frozenset({Kind.SPLIT_K}), pieces=(16,), uniform=POLICY)
    fleet = Fleet(core)
    for i in range(2):
        fleet.join(f"d{i}")
    a, b = torch.randn(32, 4096), torch.randn(4096, 24)  # 256 pieces of 16
    live = core.fleet.plan(core.planner, 32, 24, 4096, GemmKind.PLAIN, 0.0)
    assert live.plan is not None and live.plan.local_sum
    assert max(t.pieces for t in live.tiles.tiles) == MAX_PAIRS + 1
    box: dict = {}
    _, out = core.submit(a, b, GemmKind.PLAIN, fleet.now, lambda c: box.setdefault("c", c))
    fleet.route(out)
    fleet.drain()
    assert fleet.summed
    torch.testing.assert_close(box["c"], a @ b, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "kind,gemm_kind,summed",
    [
        (Kind.OUTPUT, GemmKind.FORWARD, False),
        (Kind.GRID3D, GemmKind.FORWARD, False),
        (Kind.SPLIT_K, GemmKind.FORWARD, True),
        (Kind.SPLIT_K, GemmKind.GRAD_WEIGHT, True),
        (Kind.SPLIT_K, GemmKind.GRAD_WEIGHT, False),
    ],
)
def test_results_of_live_gemms_checked_as_one_batch_are_judged_each_alone(
    kind: Kind, gemm_kind: GemmKind, summed: bool, dtype: torch.dtype
) -> None:
    """Every partition the planner makes, dW's transposed views and pieces summed on the device
    included: the blocks a check's keys name are the very tensors it reads (``freivalds_batch``
    refuses anything else), honest results pass together, and a NaN and a forged result among
    them are rejected alone."""
    from cleave.coordinator.engine.gemms import Check, run_checks

    def results(nan: int | None = None, forged: int | None = None) -> list[Check]:
        core = make_core(frozenset({kind}), local_sum=summed)
        fleet = Fleet(core)
        for i in range(4):
            fleet.join(f"d{i}")
        gen = torch.Generator().manual_seed(0)
        for _ in range(2):  # two GEMMs: keys of one never name the other's blocks
            b = torch.randn(256, 160, generator=gen).to(dtype)
            if gemm_kind is GemmKind.GRAD_WEIGHT:
                a = torch.randn(256, 192, generator=gen).to(dtype).t()  # dY^T, as the trainer passes it
            else:
                a = torch.randn(192, 256, generator=gen).to(dtype)
            _, out = core.submit(a, b, gemm_kind, fleet.now, lambda c: None)
            fleet.route(out)
        checks = []
        while fleet.pending:
            item = fleet.pending.pop(0)
            work = item.message
            assert isinstance(work, Work)
            x, y = work.operands(fleet.blocks[item.device])
            c = (x.float() @ y.float()).to(dtype)
            if len(checks) == nan:
                c[0, 0] = float("nan")
            if len(checks) == forged:
                c[1] += 1.0
            got = core.receive(item.device, Result(work.tile_id, c, 0.0005), fleet.now)
            assert isinstance(got, Check)
            checks.append(got)
        return checks

    honest = results()
    assert len(honest) > 4
    assert all(v.ok for v, _ in run_checks(honest, np.random.default_rng(1)))
    if kind is not Kind.SPLIT_K:  # a grid: tiles share blocks, so the batch has work to share
        shared = {c.product().a_key for c in honest}, {c.product().b_key for c in honest}
        assert min(len(keys) for keys in shared) < len(honest)
    verdicts = [v.ok for v, _ in run_checks(results(nan=0, forged=1), np.random.default_rng(2))]
    assert verdicts[:2] == [False, False] and all(verdicts[2:])


def test_a_seat_knows_its_links_from_join_and_follows_their_measurement() -> None:
    """The scheduler weighs a thief's transfer time (``Seat.transfer``): at join from the link
    fit's priors, then, once the device has verified work, from its measured links (refreshed
    when the next GEMM is planned). Each unit carries its blocks' and result's bytes."""
    core = make_core(None)
    fleet = Fleet(core)
    d = fleet.join("d0")
    seat = core.sched.seats[d]
    prior = core.fleet.profiles[d].profile(core.dtype)
    assert (seat.down_rate, seat.up_rate) == (prior.down, prior.up) and prior.down > 0
    a, b = torch.randn(96, 64), torch.randn(64, 80)
    submit_and_drain = []
    _, out = core.submit(a, b, GemmKind.FORWARD, fleet.now, submit_and_drain.append)
    units = [core.sched.units[t].spec for t in core.gemms[max(core.gemms)].tiles]
    assert all(u.down_bytes > 0 and u.up_bytes > 0 for u in units)
    assert sum(u.up_bytes for u in units) == a.shape[0] * b.shape[1] * 4  # the whole result, once
    fleet.route(out)
    fleet.drain()
    assert submit_and_drain  # the GEMM completed through the device
    fleet.now += 1.0
    core.submit(a, b, GemmKind.FORWARD, fleet.now, lambda c: None)  # planning refreshes the links
    measured = core.fleet.profiles[d].profile(core.dtype)
    assert (measured.down, measured.up) != (prior.down, prior.up)  # the fit moved off its priors
    assert (seat.down_rate, seat.up_rate) == (measured.down, measured.up)


@pytest.mark.parametrize("planner", [Planner.COST, Planner.UNIFORM])
def test_with_no_device_the_cost_planner_keeps_the_gemm_home_and_the_grid_waits(planner: Planner) -> None:
    """``--min-devices 0`` before anyone joins (or every device gone): the cost planner prices
    the PS alone and keeps the GEMM there, however slow the PS; the uniform grid is dealt to
    whoever comes."""
    live = LivePlanner(planner, SLOW_PS, POLICY)
    plan = live.plan(256, 256, 256, GemmKind.FORWARD, "fp32", {})
    if planner is Planner.COST:
        assert plan.tiles is None and plan.plan is not None and plan.plan.kind is Kind.LOCAL
    else:
        assert plan.tiles is not None and plan.plan is None


def test_with_gemms_in_flight_the_coordinators_cpu_takes_gemms_while_its_loop_is_busier() -> None:
    """Each lane sees a share of the PS, so alone it would ship every GEMM here; across lanes the
    loop and the CPU are shared, and a GEMM stays home whenever the CPU, loaded with those kept
    before, would finish it (by ``HOME_MARGIN``) before the loop has framed those shipped before.
    The two stay within one GEMM of each other; one lane (nothing in flight) ships them all."""
    ps = PSProfile(gflops={"fp32": 5.0}, verify_flops=1e12, unit_overhead=0.0)
    profiles = {d: Profile(gflops={"fp32": 50.0}, memory=2**30, down=1e9, up=1e9, rtt=0.001) for d in range(1, 9)}
    one = LivePlanner(Planner.COST, ps, POLICY)
    assert all(one.plan(256, 256, 256, GemmKind.FORWARD, "fp32", profiles, 0).tiles is not None for _ in range(20))
    two = LivePlanner(Planner.COST, ps, POLICY, lanes=2)
    plans = [two.plan(256, 256, 256, GemmKind.FORWARD, "fp32", profiles, 0, now=0.0) for _ in range(20)]
    home = [p for p in plans if p.tiles is None]
    shipped = [p for p in plans if p.tiles is not None]
    assert home and len(shipped) > len(home)  # the loop is cheaper a GEMM than the CPU, not free
    seconds = 2.0 * 256**3 / 5e9
    assert all(p.plan is not None and p.plan.kind is Kind.LOCAL and p.seconds == seconds for p in home)
    # Kept home, a GEMM is done when the CPU has done those before it, one after another.
    assert sorted(p.done_at for p in home) == pytest.approx([seconds * (i + 1) for i in range(len(home))])
    loop = max(p.plan.loop_seconds for p in shipped) / 2
    assert abs(len(home) * seconds * HOME_MARGIN - len(shipped) * loop) <= seconds * HOME_MARGIN + loop


@pytest.mark.parametrize(
    "planner, lanes", [(Planner.COST, 1), (Planner.COST, 2), (Planner.COST, 4), (Planner.UNIFORM, 2)]
)
def test_a_forecast_decides_each_gemm_as_its_plan_does(planner: Planner, lanes: int) -> None:
    """``forecast`` is ``plan`` without the tiles: the same finish, the same GEMMs kept home,
    and the planner's lanes, CPU and loop moved the same way, call after call."""
    ps = PSProfile(gflops={"fp32": 5.0}, verify_flops=1e12, unit_overhead=0.0)
    profiles = {d: Profile(gflops={"fp32": 10.0 * d}, memory=2**30, down=1e8, up=1e8, rtt=0.001) for d in range(1, 7)}
    planned, forecast = (LivePlanner(planner, ps, POLICY, lanes=lanes) for _ in range(2))
    shapes = [
        (256, 256, 256, GemmKind.FORWARD),
        (128, 512, 256, GemmKind.GRAD_INPUT),
        (512, 128, 64, GemmKind.GRAD_WEIGHT),
    ]
    kept = 0
    for i in range(30):
        m, n, k, kind = shapes[i % len(shapes)]
        now = 0.01 * i
        live = planned.plan(m, n, k, kind, "fp32", profiles, 0, now=now)
        done, home = forecast.forecast(m, n, k, kind, "fp32", profiles, now=now)
        assert done == live.done_at and home == (live.tiles is None and live.plan is not None)
        kept += home
        assert (planned._free_at, planned._cpu_free, planned._loop_free) == (
            forecast._free_at,
            forecast._cpu_free,
            forecast._loop_free,
        )
    assert kept or planner is Planner.UNIFORM or lanes == 1  # with lanes the balance keeps some home here
