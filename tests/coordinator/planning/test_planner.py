"""The planner: hand-checked decisions, and invariants on random GEMMs and fleets."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cleave.coordinator.planning.costmodel import (
    CostModelError,
    DeviceClass,
    LoopCosts,
    Profile,
    PSProfile,
    in_flight_memory,
)
from cleave.coordinator.planning.planner import (
    Gemm,
    Kind,
    PlannerOptions,
    baseline,
    candidates,
    plan_gemm,
    plan_step,
    realize,
    uniform_shapes,
)
from cleave.coordinator.planning.tiles import GemmKind, TilingPolicy
from cleave.coordinator.planning.tiles import plan_gemm as uniform_grid

MB = 1e6
GIB = 1 << 30
LAPTOP = Profile({"fp32": 200.0, "bf16": 2.0}, memory=8 * GIB, down=50 * MB, up=10 * MB, rtt=0.03)
GPU = Profile({"fp32": 20_000.0, "bf16": 80_000.0}, memory=16 * GIB, down=100 * MB, up=50 * MB, rtt=0.02)
PS = PSProfile.from_link(10.0, gflops={"fp32": 500.0, "bf16": 500.0}, verify_flops=1e11, memory_bw=2e10)
FREE_LOOP = LoopCosts(0.0, 0.0, 0.0, 0.0)  # an event loop that costs nothing (tests of other limits)
FORCED = [Kind.OUTPUT, Kind.SPLIT_K, Kind.GRID3D]
COST_KINDS = frozenset(Kind) - {Kind.UNIFORM}


def forced(kind: Kind) -> PlannerOptions:
    return PlannerOptions(kinds=frozenset({kind}))


def assert_exact_cover(plan) -> None:
    """Every output element is computed once (output tiles) or summed once per reduction index:
    the realised units, computed and added up, give A @ B."""
    g = plan.gemm
    a, b = torch.randn(g.m, g.k, dtype=torch.float64), torch.randn(g.k, g.n, dtype=torch.float64)
    c = torch.zeros(g.m, g.n, dtype=torch.float64)
    volume = 0
    for u in realize(plan):
        c[u.r0 : u.r1, u.c0 : u.c1] += a[u.r0 : u.r1, u.k0 : u.k1] @ b[u.k0 : u.k1, u.c0 : u.c1]
        volume += (u.r1 - u.r0) * (u.c1 - u.c0) * (u.k1 - u.k0)
    assert volume == g.m * g.n * g.k  # no element twice ...
    torch.testing.assert_close(c, a @ b)  # ... and none missing


def realized_down(plan) -> dict[tuple[str, int], int]:
    """Bytes each device of the plan needs for its realised units: every distinct A block
    (rows x reduction range) and B block (reduction range x columns) once."""
    blocks: dict[tuple[str, int], set] = {}
    for u in realize(plan):
        held = blocks.setdefault((u.owner, u.device), set())
        held |= {("a", u.r0, u.r1, u.k0, u.k1), ("b", u.k0, u.k1, u.c0, u.c1)}
    s = plan.gemm.itemsize
    return {device: s * sum((b[2] - b[1]) * (b[4] - b[3]) for b in held) for device, held in blocks.items()}


def assert_priced_at_least_realized(plan) -> None:
    """What the plan charges a device is never less than what its realised units need."""
    need = realized_down(plan)
    assert sum(need.values()) <= plan.egress_bytes * (1 + 1e-12)
    for share in plan.shares:
        assert sum(b for (o, _), b in need.items() if o == share.name) <= share.down_bytes * (1 + 1e-12)
    by = {s.name: s for s in plan.shares}
    for (owner, _), bytes_ in need.items():  # and each device: the busiest is charged the most
        assert bytes_ <= by[owner].device_down * (1 + 1e-12), (owner, bytes_, by[owner].device_down)


# --------------------------------------------------------------------------- decisions by hand


def test_a_small_gemm_stays_on_the_parameter_server() -> None:
    # 64^3 is 0.5 MFLOP: a millisecond on the PS, a 30 ms round trip away on any laptop.
    plan = plan_gemm(Gemm(64, 64, 64), (DeviceClass("laptop", 100, LAPTOP),), PS)
    assert plan.kind is Kind.LOCAL
    assert plan.seconds == pytest.approx(2 * 64**3 / 500e9)
    assert realize(plan) == []


def test_a_big_gemm_goes_to_the_fleet_and_beats_round_robin() -> None:
    fleet = (DeviceClass("laptop", 200, LAPTOP), DeviceClass("gpu", 20, GPU))
    gemm = Gemm(16384, 4096, 4096, kind="fwd")
    plan = plan_gemm(gemm, fleet, PS)
    assert plan.kind is not Kind.LOCAL and plan.devices > 0
    base = baseline(gemm, fleet, PS)
    assert base is not None and plan.seconds <= base.seconds
    # Fast devices take more: the GPUs' busiest device has more pieces than the laptops'.
    by = {s.name: s for s in plan.shares}
    if "laptop" in by and "gpu" in by:
        assert by["gpu"].per_device >= by["laptop"].per_device
    assert_exact_cover(plan_gemm(Gemm(2048, 1024, 512, kind="fwd"), fleet, PS, forced(Kind.OUTPUT)))


def test_devices_that_would_lengthen_the_step_are_left_idle() -> None:
    snail = Profile({"fp32": 0.05}, memory=8 * GIB, down=50 * MB, up=10 * MB)  # 4000x slower
    tiny_memory = Profile({"fp32": 200.0}, memory=1 << 20, down=50 * MB, up=10 * MB)
    flaky = Profile({"fp32": 200.0}, memory=8 * GIB, down=50 * MB, up=10 * MB, reliability=0.2)
    thin = Profile({"fp32": 200.0}, memory=8 * GIB, down=2e3, up=1e3)  # a 16 kbit/s link
    fleet = (
        DeviceClass("laptop", 64, LAPTOP),
        DeviceClass("snail", 8, snail),
        DeviceClass("tiny", 8, tiny_memory),
        DeviceClass("flaky", 8, flaky),
        DeviceClass("thin", 8, thin),
    )
    plan = plan_gemm(Gemm(8192, 4096, 4096, kind="fwd"), fleet, PS, forced(Kind.OUTPUT))
    assert {s.name for s in plan.shares} == {"laptop"}


def test_a_dtype_the_device_runs_slowly_is_priced_as_slow() -> None:
    # bf16 on these laptops is 100x slower than fp32 (no native bf16): in bf16 the GPUs get most work.
    # The PS's event loop free: priced, its bytes bind before the laptops' compute in fp32 (the
    # plan then takes the fewest devices that keep up with it), which is not what this tests.
    ps = dataclasses.replace(PS, loop=FREE_LOOP)
    fleet = (DeviceClass("laptop", 500, LAPTOP), DeviceClass("gpu", 4, GPU))
    fp32 = plan_gemm(Gemm(32768, 4096, 4096, "fp32", "fwd"), fleet, ps, forced(Kind.OUTPUT))
    bf16 = plan_gemm(Gemm(32768, 4096, 4096, "bf16", "fwd"), fleet, ps, forced(Kind.OUTPUT))

    def laptops_share(plan) -> float:
        return sum(s.pieces for s in plan.shares if s.name == "laptop") / sum(s.pieces for s in plan.shares)

    assert laptops_share(fp32) > 0.5 and laptops_share(bf16) < laptops_share(fp32) / 2


def test_output_tiles_send_at_least_the_square_bound() -> None:
    # P equal devices with equal square regions: the PS sends 2 s K sqrt(P M N) and no less.
    dev = Profile({"fp32": 100.0}, memory=64 * GIB, down=1e9, up=1e9, rtt=0.0, overhead=0.0)
    # Every PS cost but its link nil (its event loop's too: bytes it frames would bind first).
    ps = PSProfile.from_link(
        1000.0, verify_flops=1e15, unit_overhead=0.0, memory_bw=1e15, gflops={"fp32": 1e-3}, loop=FREE_LOOP
    )
    gemm = Gemm(4096, 4096, 1024, kind="fwd")
    one_tile_each = TilingPolicy(max_edge=1024, tiles_per_device=1)  # the uniform grid is 4 x 4 too
    plan = plan_gemm(
        gemm,
        (DeviceClass("d", 16, dev),),
        ps,
        PlannerOptions(kinds=frozenset({Kind.OUTPUT}), edges=(1024,), uniform=one_tile_each),
    )
    assert plan.devices == 16 and plan.grid == (4, 4, 1)  # each with a square region: one 1024-tile
    floor = 2 * 4 * 1024 * math.sqrt(16 * 4096 * 4096)
    assert plan.egress_floor == pytest.approx(floor)
    assert plan.egress_bytes == pytest.approx(floor)  # square tiles meet the bound exactly
    # With 2 x 2 tiles of 512 each, a device's run is priced wherever it might start in its band
    # (one column more than an aligned block): never less than the block it actually gets.
    finer = plan_gemm(
        gemm, (DeviceClass("d", 16, dev),), ps, PlannerOptions(kinds=frozenset({Kind.OUTPUT}), edges=(512,))
    )
    assert finer.grid == (8, 8, 1) and finer.shares[0].per_device == 4
    assert set(realized_down(finer).values()) == {4 * 1024 * 4 * 512}  # 2 row blocks + 2 column blocks
    assert_priced_at_least_realized(finer)


def test_3d_trades_downlink_for_uplink() -> None:
    fleet = (DeviceClass("laptop", 256, LAPTOP),)
    gemm = Gemm(8192, 8192, 8192, kind="fwd")
    flat = plan_gemm(gemm, fleet, PS, PlannerOptions(kinds=frozenset({Kind.OUTPUT}), edges=(1024,)))
    deep = plan_gemm(gemm, fleet, PS, PlannerOptions(kinds=frozenset({Kind.GRID3D}), edges=(1024,), slabs=(4,)))
    assert deep.egress_bytes < flat.egress_bytes and deep.ingress_bytes > flat.ingress_bytes
    small = plan_gemm(
        Gemm(1024, 512, 2048),
        (DeviceClass("laptop", 16, LAPTOP),),
        PS,
        PlannerOptions(kinds=frozenset({Kind.GRID3D}), edges=(256,), slabs=(4,)),
    )
    assert small.kind is Kind.GRID3D and small.grid[2] == 4
    assert_exact_cover(small)


def test_split_k_devices_sum_their_own_pieces_and_reuse_what_they_hold() -> None:
    fleet = (DeviceClass("a", 1, LAPTOP), DeviceClass("b", 1, GPU))
    gemm = Gemm(384, 1024, 2048, kind="dw", k_piece=512)  # dW over 4 aligned token pieces
    plan = plan_gemm(gemm, fleet, PS, forced(Kind.SPLIT_K))
    assert plan.grid[2] == 4
    assert_exact_cover(plan)
    held = plan_gemm(gemm, fleet, PS, forced(Kind.SPLIT_K), held={"a": 2, "b": 2})
    assert held.egress_bytes < plan.egress_bytes and held.seconds <= plan.seconds


def test_no_feasible_plan_is_a_clear_error() -> None:
    only_bf16 = Profile({"bf16": 10.0}, memory=GIB, down=MB, up=MB)
    with pytest.raises(CostModelError, match="no feasible plan"):
        plan_gemm(Gemm(512, 512, 512, "fp32"), (DeviceClass("x", 4, only_bf16),), PS, forced(Kind.OUTPUT))


def test_the_round_robin_grid_is_priced_for_any_fleet_size() -> None:
    # Above 64 devices the counts used to step coarsely and skip grids: 129 devices' (1, 258, 1).
    gemm = Gemm(512, 65536, 512, kind="fwd")
    policy = TilingPolicy()
    for devices in (129, 131, 200, 1000):
        shapes = uniform_shapes(gemm, devices, policy)
        assert uniform_grid(512, 65536, 512, GemmKind.FORWARD, devices, policy).shape in shapes
        assert (1, 258, 1) in shapes  # every grid of a smaller fleet stays
        assert len(shapes) == len(set(shapes))
    grids = {c.grid for c in candidates(gemm, 129, PlannerOptions(kinds=frozenset({Kind.OUTPUT})))}
    assert (1, 258, 1) in grids


@pytest.mark.parametrize(
    "m, n, k, kind",
    [
        (512, 65536, 512, "fwd"),
        (2048, 8192, 2048, "dx"),
        (700, 300, 9000, "dw"),
        (96, 96, 96, "mm"),
        (4096, 1024, 65536, "dw"),
    ],
)
def test_uniform_shapes_are_every_distinct_grid_of_smaller_fleets(m: int, n: int, k: int, kind: str) -> None:
    policy = TilingPolicy()
    devices = 300
    every: list[tuple[int, int, int]] = []
    for count in range(1, devices + 1):
        shape = uniform_grid(m, n, k, GemmKind(kind), count, policy).shape
        if shape not in every:
            every.append(shape)
    assert uniform_shapes(Gemm(m, n, k, kind=kind), devices, policy) == every


def test_aligned_gemms_keep_their_token_cuts_in_every_plan() -> None:
    # An aligned dW's reduction is the tokens in 512-pieces that devices already hold: a split-K
    # grid of another piece count (the round-robin grid of many devices) would count held pieces
    # of the wrong size (it once sent nothing at all).
    gemm = Gemm(384, 1024, 4096, kind="dw", k_piece=512)
    for n in (1, 4, 16):
        fleet = (DeviceClass("a", n, LAPTOP), DeviceClass("b", n, GPU))
        plan = plan_gemm(gemm, fleet, PS, forced(Kind.SPLIT_K), held={"a": 2, "b": 2})
        assert plan.grid[2] == 8
        assert plan.egress_bytes >= plan.egress_floor
    forward = Gemm(2048, 4096, 1024, kind="fwd", row_piece=512)
    fleet = (DeviceClass("laptop", 50, LAPTOP),)
    for kind in (Kind.OUTPUT, Kind.GRID3D):
        assert plan_gemm(forward, fleet, PS, forced(kind)).grid[0] == 4
    plan = plan_gemm(forward, fleet, PS)
    base = baseline(forward, fleet, PS)
    assert base is not None and base.grid[0] == 4 and plan.seconds <= base.seconds


def test_uniform_alone_is_exactly_round_robin() -> None:
    fleet = (DeviceClass("laptop", 5, LAPTOP), DeviceClass("gpu", 2, GPU))
    gemm = Gemm(2048, 1536, 768, kind="fwd")
    plan = plan_gemm(gemm, fleet, PS, forced(Kind.UNIFORM))
    assert plan == baseline(gemm, fleet, PS)
    assert plan.kind is Kind.UNIFORM and plan.devices == 7
    assert_exact_cover(plan)
    units = realize(plan)
    tiles = uniform_grid(gemm.m, gemm.n, gemm.k, GemmKind.FORWARD, 7, PlannerOptions().uniform).tiles
    assert [(u.r0, u.c0, u.k0) for u in units] == [(t.r0, t.c0, t.k0) for t in tiles]
    assert [u.device for u in units] == [t.index % 7 for t in tiles]  # tile t to device t mod P
    assert {(u.owner, u.member) for u in units if u.device >= 5} == {("gpu", 0), ("gpu", 1)}
    assert realized_down(plan) and sum(realized_down(plan).values()) == pytest.approx(plan.egress_bytes)
    # With every kind allowed it is one candidate among others, and an equally fast cost plan wins.
    everything = plan_gemm(gemm, fleet, PS, PlannerOptions(kinds=COST_KINDS | {Kind.UNIFORM}))
    cost = plan_gemm(gemm, fleet, PS, PlannerOptions(kinds=COST_KINDS))
    assert everything.seconds == pytest.approx(min(cost.seconds, plan.seconds), rel=1e-9)
    assert everything.kind is not Kind.UNIFORM or plan.seconds < cost.seconds


def test_realised_units_never_need_more_than_priced() -> None:
    # Units used to be dealt as row-major strips while priced as squares: on docs/cost-model.md's
    # example they downloaded 45,219,840 B against 28,634,221 B priced.
    laptop = Profile({"fp32": 100.0}, memory=4 * GIB, down=25e6, up=2.5e6, rtt=0.04)
    desktop = Profile({"fp32": 1000.0}, memory=8 * GIB, down=125e6, up=12.5e6, rtt=0.02)
    fleet = (DeviceClass("laptop", 2, laptop), DeviceClass("desktop", 2, desktop))
    for kind in (Kind.OUTPUT, Kind.GRID3D, Kind.SPLIT_K):
        plan = plan_gemm(Gemm(2048, 3072, 768, kind="fwd"), fleet, PSProfile.from_link(10.0), forced(kind))
        assert_priced_at_least_realized(plan)
        assert_exact_cover(plan)


def test_split_k_floor_subtracts_what_devices_hold() -> None:
    # Two of four aligned pieces are on the device already: only the other two need to go down.
    gemm = Gemm(384, 1024, 2048, kind="dw", k_piece=512)
    plan = plan_gemm(gemm, (DeviceClass("a", 1, LAPTOP),), PS, forced(Kind.SPLIT_K), held={"a": 2})
    piece = 4 * (384 + 1024) * 512
    assert plan.egress_bytes == 2 * piece
    assert plan.egress_floor == 2 * piece  # 4 pieces once, less the 2 it holds


def test_round_robin_memory_and_floor_are_defined_as_the_planners() -> None:
    # Memory: two tiles in flight, as a plan's devices (it used to report every byte sent plus
    # two results, while feasibility checked two tiles).
    gemm = Gemm(2048, 1536, 768, kind="fwd")  # 4 x 3 tiles of 512 x 512, 4 to each of 3 devices
    base = baseline(gemm, (DeviceClass("a", 3, LAPTOP),), PS)
    tile = 4 * (512 * 768 + 768 * 512 + 512 * 512)
    assert base is not None and base.grid == (4, 3, 1) and base.shares[0].per_device == 4
    assert base.shares[0].memory == in_flight_memory(4, tile) == 2 * tile
    small = Profile({"fp32": 200.0}, memory=2 * tile - 1, down=50 * MB, up=10 * MB)
    assert baseline(gemm, (DeviceClass("a", 3, small),), PS).seconds == math.inf  # never finishes, and says so
    assert plan_gemm(gemm, (DeviceClass("a", 3, small),), PS, forced(Kind.OUTPUT)).shares[0].memory <= 2 * tile - 1
    # Floor of a split grid: split-K's, every input piece at least once (a device here takes
    # pieces of any cell, so the whole output is one cell).
    dw = Gemm(384, 1024, 2048, kind="dw")  # split grid (1, 1, 6) for 3 devices
    split = baseline(dw, (DeviceClass("a", 3, LAPTOP),), PS)
    assert split is not None and split.grid == (1, 1, 6)
    assert split.egress_floor == 4 * 2048 * (384 + 1024) <= split.egress_bytes


def test_a_step_sums_its_gemms_and_reports_utilisation() -> None:
    fleet = (DeviceClass("laptop", 100, LAPTOP),)
    gemms = [(Gemm(8192, 4096, 4096, kind="fwd"), 2), (Gemm(4096, 4096, 8192, kind="dw"), 2)]
    step = plan_step(gemms, fleet, PS, ps_other_seconds=1.5)
    assert step.seconds == pytest.approx(sum(p.seconds * n for p, n in step.plans) + 1.5)
    assert step.flops == 2 * (2 * 8192 * 4096 * 4096) * 2
    assert 0 < step.utilisation < 1


# --------------------------------------------------------------------------- invariants


def profiles() -> st.SearchStrategy[Profile]:
    return st.builds(
        Profile,
        gflops=st.fixed_dictionaries({"fp32": st.floats(1.0, 5e4)}),
        memory=st.integers(1 << 20, 32 * GIB),
        down=st.floats(1e5, 1e9),
        up=st.floats(1e4, 5e8),
        rtt=st.floats(0.0, 0.2),
        reliability=st.floats(0.3, 1.0),
        session=st.sampled_from([math.inf, 600.0, 7200.0]),
    )


fleets = st.lists(st.tuples(st.integers(1, 12), profiles()), min_size=1, max_size=3).map(
    lambda xs: tuple(DeviceClass(f"c{i}", n, p) for i, (n, p) in enumerate(xs))
)
sizes = st.integers(1, 700)
plain_gemms = st.builds(Gemm, sizes, sizes, sizes, kind=st.sampled_from(["fwd", "dx", "dw", "mm"]))
# Token-aligned GEMMs, as the live scheduler asks for them: forward and dX rows, dW's reduction,
# in pieces (512 is the uniform grid's own edge, so its grid is usually aligned too).
aligned_gemms = st.builds(
    lambda m, n, k, kind, piece: Gemm(
        m, n, k, kind=kind, row_piece=piece if kind != "dw" else 0, k_piece=piece if kind == "dw" else 0
    ),
    sizes,
    sizes,
    sizes,
    st.sampled_from(["fwd", "dx", "dw"]),
    st.sampled_from([64, 200, 512]),
)
gemms = st.one_of(plain_gemms, aligned_gemms)
helds = st.dictionaries(st.sampled_from(["c0", "c1", "c2"]), st.integers(0, 8), max_size=3)
ps_profiles = st.builds(
    PSProfile.from_link,
    st.floats(0.01, 100.0),
    gflops=st.fixed_dictionaries({"fp32": st.floats(0.001, 1000.0)}),
    verify_flops=st.floats(1e8, 1e12),
    unit_overhead=st.floats(0.0, 1e-2),
)
SLOW = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
OPTS = PlannerOptions(edges=(64, 256, 1024), pieces=(128, 512), slabs=(2, 4))


def _plan(gemm: Gemm, fleet, ps, opts: PlannerOptions = OPTS, held=None):
    try:
        return plan_gemm(gemm, fleet, ps, opts, held=held)
    except CostModelError:
        return None


def _aligned(gemm: Gemm, grid: tuple[int, int, int]) -> bool:
    rows, _, parts = grid
    return (not gemm.row_piece or rows == -(-gemm.m // gemm.row_piece)) and (
        not gemm.k_piece or parts == 1 or parts == -(-gemm.k // gemm.k_piece)
    )


@SLOW
@given(gemms, fleets, ps_profiles, st.sampled_from(FORCED + [Kind.UNIFORM]))
def test_every_partition_covers_the_gemm_once_and_respects_memory(gemm, fleet, ps, kind) -> None:
    plan = _plan(gemm, fleet, ps, PlannerOptions(kinds=frozenset({kind}), edges=(64, 256), pieces=(128,), slabs=(2,)))
    assume(plan is not None)
    assert_exact_cover(plan)
    assert_priced_at_least_realized(plan)
    assert _aligned(gemm, plan.grid)
    profiles = {c.name: c.profile for c in fleet}
    count = {c.name: c.count for c in fleet}
    for share in plan.shares:
        assert share.memory <= profiles[share.name].memory
        assert 0 < share.devices <= count[share.name]
        assert share.seconds <= plan.seconds * (1 + 1e-9)
    assert plan.egress_bytes >= plan.egress_floor * (1 - 1e-9)


@SLOW
@given(gemms, fleets, ps_profiles, helds, st.sampled_from(FORCED + [Kind.UNIFORM]))
def test_no_plan_sends_less_than_its_floor(gemm, fleet, ps, held, kind) -> None:
    plan = _plan(
        gemm, fleet, ps, PlannerOptions(kinds=frozenset({kind}), edges=(64, 256), pieces=(128,), slabs=(2,)), held
    )
    assume(plan is not None)
    assert 0 <= plan.egress_floor <= plan.egress_bytes * (1 + 1e-9)


@SLOW
@given(gemms, fleets, ps_profiles)
def test_the_plan_is_never_slower_than_round_robin(gemm, fleet, ps) -> None:
    plan = _plan(gemm, fleet, ps)
    base = baseline(gemm, fleet, ps, OPTS)
    assume(plan is not None and base is not None and math.isfinite(base.seconds))
    assume(_aligned(gemm, base.grid))  # round-robin's grid may cut an aligned GEMM's tokens otherwise
    assert plan.seconds <= base.seconds * (1 + 1e-9)
    # Round-robin is one candidate among the others: the plan is the faster of it and of the rest.
    cost = _plan(
        gemm, fleet, ps, PlannerOptions(edges=OPTS.edges, pieces=OPTS.pieces, slabs=OPTS.slabs, kinds=COST_KINDS)
    )
    assert cost is not None
    assert plan.seconds == pytest.approx(min(cost.seconds, base.seconds), rel=1e-9)


@SLOW
@given(gemms, fleets, ps_profiles, st.integers(0, 2), st.integers(1, 3), profiles())
def test_adding_devices_never_makes_the_prediction_slower(gemm, fleet, ps, which, more, newcomer) -> None:
    # The cost kinds (round-robin is not monotone itself: a device more can break its dealing,
    # so a plan that may pick it cannot be either).
    opts = PlannerOptions(edges=OPTS.edges, pieces=OPTS.pieces, slabs=OPTS.slabs, kinds=COST_KINDS)
    before = _plan(gemm, fleet, ps, opts)
    assume(before is not None)
    if which < len(fleet):  # more devices of a class already there
        grown = tuple(DeviceClass(c.name, c.count + more, c.profile) if i == which else c for i, c in enumerate(fleet))
    else:  # a class of new devices
        grown = fleet + (DeviceClass("new", more, newcomer),)
    after = _plan(gemm, grown, ps, opts)
    assert after is not None
    assert after.seconds <= before.seconds * (1 + 1e-6)
