"""The planner: hand-checked decisions, and invariants on random GEMMs and fleets."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from coordinator.costmodel import CostModelError, DeviceClass, Profile, PSProfile
from coordinator.planner import Gemm, Kind, PlannerOptions, baseline, plan_gemm, plan_step, realize

MB = 1e6
GIB = 1 << 30
LAPTOP = Profile({"fp32": 200.0, "bf16": 2.0}, memory=8 * GIB, down=50 * MB, up=10 * MB, rtt=0.03)
GPU = Profile({"fp32": 20_000.0, "bf16": 80_000.0}, memory=16 * GIB, down=100 * MB, up=50 * MB, rtt=0.02)
PS = PSProfile.from_link(10.0, gflops={"fp32": 500.0, "bf16": 500.0}, verify_flops=1e11, memory_bw=2e10)
FORCED = [Kind.OUTPUT, Kind.SPLIT_K, Kind.GRID3D]


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
        c[u.r0:u.r1, u.c0:u.c1] += a[u.r0:u.r1, u.k0:u.k1] @ b[u.k0:u.k1, u.c0:u.c1]
        volume += (u.r1 - u.r0) * (u.c1 - u.c0) * (u.k1 - u.k0)
    assert volume == g.m * g.n * g.k  # no element twice ...
    torch.testing.assert_close(c, a @ b)  # ... and none missing


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
    fleet = (DeviceClass("laptop", 64, LAPTOP), DeviceClass("snail", 8, snail), DeviceClass("tiny", 8, tiny_memory),
             DeviceClass("flaky", 8, flaky), DeviceClass("thin", 8, thin))
    plan = plan_gemm(Gemm(8192, 4096, 4096, kind="fwd"), fleet, PS, forced(Kind.OUTPUT))
    assert {s.name for s in plan.shares} == {"laptop"}


def test_a_dtype_the_device_runs_slowly_is_priced_as_slow() -> None:
    # bf16 on these laptops is 100x slower than fp32 (no native bf16): in bf16 the GPUs get most work.
    fleet = (DeviceClass("laptop", 500, LAPTOP), DeviceClass("gpu", 4, GPU))
    fp32 = plan_gemm(Gemm(32768, 4096, 4096, "fp32", "fwd"), fleet, PS, forced(Kind.OUTPUT))
    bf16 = plan_gemm(Gemm(32768, 4096, 4096, "bf16", "fwd"), fleet, PS, forced(Kind.OUTPUT))
    def laptops_share(plan) -> float:
        return sum(s.pieces for s in plan.shares if s.name == "laptop") / sum(s.pieces for s in plan.shares)

    assert laptops_share(fp32) > 0.5 and laptops_share(bf16) < laptops_share(fp32) / 2


def test_output_tiles_send_at_least_the_square_bound() -> None:
    # P equal devices with equal square regions: the PS sends 2 s K sqrt(P M N) and no less.
    dev = Profile({"fp32": 100.0}, memory=64 * GIB, down=1e9, up=1e9, rtt=0.0, overhead=0.0)
    ps = PSProfile.from_link(1000.0, verify_flops=1e15, unit_overhead=0.0, memory_bw=1e15, gflops={"fp32": 1e-3})
    gemm = Gemm(4096, 4096, 1024, kind="fwd")
    plan = plan_gemm(gemm, (DeviceClass("d", 16, dev),), ps, PlannerOptions(kinds=frozenset({Kind.OUTPUT}), edges=(1024,)))
    assert plan.devices == 16  # each with a square region (one 1024-tile, or 2 x 2 of 512)
    floor = 2 * 4 * 1024 * math.sqrt(16 * 4096 * 4096)
    assert plan.egress_floor == pytest.approx(floor)
    assert plan.egress_bytes == pytest.approx(floor)  # square tiles meet the bound exactly


def test_3d_trades_downlink_for_uplink() -> None:
    fleet = (DeviceClass("laptop", 256, LAPTOP),)
    gemm = Gemm(8192, 8192, 8192, kind="fwd")
    flat = plan_gemm(gemm, fleet, PS, PlannerOptions(kinds=frozenset({Kind.OUTPUT}), edges=(1024,)))
    deep = plan_gemm(gemm, fleet, PS, PlannerOptions(kinds=frozenset({Kind.GRID3D}), edges=(1024,), slabs=(4,)))
    assert deep.egress_bytes < flat.egress_bytes and deep.ingress_bytes > flat.ingress_bytes
    small = plan_gemm(Gemm(1024, 512, 2048), (DeviceClass("laptop", 16, LAPTOP),), PS,
                      PlannerOptions(kinds=frozenset({Kind.GRID3D}), edges=(256,), slabs=(4,)))
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
    lambda xs: tuple(DeviceClass(f"c{i}", n, p) for i, (n, p) in enumerate(xs)))
gemms = st.builds(Gemm, st.integers(1, 700), st.integers(1, 700), st.integers(1, 700),
                  kind=st.sampled_from(["fwd", "dx", "dw", "mm"]))
ps_profiles = st.builds(PSProfile.from_link, st.floats(0.01, 100.0),
                        gflops=st.fixed_dictionaries({"fp32": st.floats(0.001, 1000.0)}),
                        verify_flops=st.floats(1e8, 1e12), unit_overhead=st.floats(0.0, 1e-2))
SLOW = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
OPTS = PlannerOptions(edges=(64, 256, 1024), pieces=(128, 512), slabs=(2, 4))


def _plan(gemm: Gemm, fleet, ps, opts: PlannerOptions = OPTS):
    try:
        return plan_gemm(gemm, fleet, ps, opts)
    except CostModelError:
        return None


@SLOW
@given(gemms, fleets, ps_profiles, st.sampled_from(FORCED))
def test_every_partition_covers_the_gemm_once_and_respects_memory(gemm, fleet, ps, kind) -> None:
    plan = _plan(gemm, fleet, ps, PlannerOptions(kinds=frozenset({kind}), edges=(64, 256), pieces=(128,), slabs=(2,)))
    assume(plan is not None)
    assert_exact_cover(plan)
    profiles = {c.name: c.profile for c in fleet}
    count = {c.name: c.count for c in fleet}
    for share in plan.shares:
        assert share.memory <= profiles[share.name].memory
        assert 0 < share.devices <= count[share.name]
        assert share.seconds <= plan.seconds * (1 + 1e-9)
    if plan.kind is not Kind.SPLIT_K:
        assert plan.egress_bytes >= plan.egress_floor * (1 - 1e-9)


@SLOW
@given(gemms, fleets, ps_profiles)
def test_the_plan_is_never_slower_than_round_robin(gemm, fleet, ps) -> None:
    plan = _plan(gemm, fleet, ps)
    base = baseline(gemm, fleet, ps, OPTS)
    assume(plan is not None and base is not None and math.isfinite(base.seconds))
    assert plan.seconds <= base.seconds * (1 + 1e-6)  # float noise: tile sizes are averaged


@SLOW
@given(gemms, fleets, ps_profiles, st.integers(0, 2), st.integers(1, 3), profiles())
def test_adding_devices_never_makes_the_prediction_slower(gemm, fleet, ps, which, more, newcomer) -> None:
    before = _plan(gemm, fleet, ps)
    assume(before is not None)
    if which < len(fleet):  # more devices of a class already there
        grown = tuple(DeviceClass(c.name, c.count + more, c.profile) if i == which else c for i, c in enumerate(fleet))
    else:  # a class of new devices
        grown = fleet + (DeviceClass("new", more, newcomer),)
    after = _plan(gemm, grown, ps)
    assert after is not None
    assert after.seconds <= before.seconds * (1 + 1e-6)
