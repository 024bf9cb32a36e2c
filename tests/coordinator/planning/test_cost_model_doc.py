"""docs/cost-model.md's worked examples, recomputed with the code: the page cannot drift from it.

Every figure of the page's "Checked figures" table is computed here from the examples' inputs
(coordinator/planning/costmodel.py, coordinator/planning/planner.py) and compared to the digits the page prints;
each figure must also be quoted in the page's text, not only in the table.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

import pytest
from conftest import ROOT

from cleave.coordinator.planning.costmodel import (
    DeviceClass,
    LoopCosts,
    Profile,
    PSProfile,
    Stage,
    Unit,
    local_seconds,
    output_tiles_egress_floor,
    pipeline,
    pipelined,
    stage,
)
from cleave.coordinator.planning.planner import (
    Gemm,
    Kind,
    PlannerOptions,
    _grid_candidate,
    _price,
    baseline,
    plan_gemm,
    plan_step,
    realize,
)
from cleave.coordinator.whatif.presets import model_shape, step_gemms

DOC = ROOT / "docs" / "cost-model.md"
GIB = 1 << 30

# The examples' inputs, as the page states them.
LAPTOP = Profile({"fp32": 100.0, "bf16": 2.0}, memory=4 * GIB, down=200e6 / 8, up=20e6 / 8, rtt=0.04)
DESKTOP = Profile({"fp32": 1000.0, "bf16": 2000.0}, memory=8 * GIB, down=1e9 / 8, up=100e6 / 8, rtt=0.02)
GPU = Profile({"fp32": 50_000.0, "bf16": 110_000.0}, memory=24 * GIB, down=1e9 / 8, up=500e6 / 8, rtt=0.015)
FLEET = (DeviceClass("laptop", 2, LAPTOP), DeviceClass("desktop", 2, DESKTOP))
GPUS = (DeviceClass("gpu", 16, GPU),)
# The examples price every check alone, and leave the event loop out (derived by hand without
# it: the loop's costs came later, and the page shows example 3 with them as a figure of its own).
PS = PSProfile.from_link(10.0, check_columns=1, loop=LoopCosts(0.0, 0.0, 0.0, 0.0))
WITH_LOOP = PSProfile.from_link(10.0, check_columns=1)  # the loop at LOOP_COSTS
NO_LOCAL = PlannerOptions(kinds=frozenset(Kind) - {Kind.LOCAL})
EX1 = Gemm(2048, 3072, 768, "fp32", "fwd")  # A 2048 x 768, B 768 x 3072
EX2 = Gemm(512, 352, 64, "fp32", "fwd")  # tiny's gate_up forward on 8 x 64 tokens
EX3 = Gemm(2048, 50272, 2048, "bf16", "fwd")  # an output head: 2048 wide, 50,272 tokens of vocabulary


def _shares(plan) -> dict:
    return {s.name: s for s in plan.shares}


def _realized(plan) -> dict[tuple[str, int], int]:
    """Bytes each device's realised units download: each distinct block once per device."""
    blocks: dict[tuple[str, int], set] = defaultdict(set)
    for u in realize(plan):
        blocks[(u.owner, u.device)] |= {("a", u.r0, u.r1, u.k0, u.k1), ("b", u.k0, u.k1, u.c0, u.c1)}
    s = plan.gemm.itemsize
    return {device: s * sum((b[2] - b[1]) * (b[4] - b[3]) for b in held) for device, held in blocks.items()}


def _per_class(realized: dict[tuple[str, int], int], name: str) -> int:
    values = {v for (owner, _), v in realized.items() if owner == name}
    assert len(values) == 1, f"the {name}s' realised units differ: {values}"
    return values.pop()


def figures() -> dict[str, object]:
    g = EX1
    tile512, tile128 = Unit(512, 512, 768, 4), Unit(128, 128, 768, 4)
    lap512, desk512 = stage(tile512, LAPTOP, "fp32"), stage(tile512, DESKTOP, "fp32")
    lap128, desk128 = stage(tile128, LAPTOP, "fp32"), stage(tile128, DESKTOP, "fp32")
    c_bytes = g.itemsize * g.m * g.n
    base = baseline(g, FLEET, PS)
    plan = plan_gemm(g, FLEET, PS, NO_LOCAL)
    one_band = _price(_grid_candidate(g, 16, 24, 1, 1, PlannerOptions()), g, FLEET, PS)  # the same grid, 1 band
    by = _shares(plan)
    desk, lap = by["desktop"], by["laptop"]
    realized = _realized(plan)
    desk_fill = desk128.down + desk128.compute + DESKTOP.rtt
    lap_fill = lap128.down + lap128.compute + LAPTOP.rtt
    only = {
        kind: plan_gemm(g, FLEET, PS, PlannerOptions(kinds=frozenset({kind}))) for kind in (Kind.GRID3D, Kind.SPLIT_K)
    }
    plan512 = plan_gemm(g, FLEET, PS, PlannerOptions(kinds=frozenset({Kind.OUTPUT}), edges=(512,)))
    whole = Unit(g.m, g.n, g.k, g.itemsize)

    plan2 = plan_gemm(EX2, FLEET, PS, NO_LOCAL)
    rows, cols, _ = plan2.grid
    lap_tile2 = stage(Unit(EX2.m / rows, EX2.n / cols, EX2.k, 4), LAPTOP, "fp32")
    tiny = model_shape("tiny")
    step = plan_step([(Gemm(x.m, x.n, x.k, "fp32", x.kind), x.count) for x in step_gemms(tiny, 8, 64)], FLEET, PS)
    assert all(p.kind is Kind.LOCAL for p, _ in step.plans) and len(step.plans) == 15

    plan3 = plan_gemm(EX3, GPUS, PS)
    gpu3 = _shares(plan3)["gpu"]
    r3, c3, _ = plan3.grid
    tile3 = Unit(EX3.m / r3, EX3.n / c3, EX3.k, 2)

    return {
        "ps.verify_ratio": 16 * PS.flops_per_s("fp32") / PS.verify_flops,
        "ps.link_ratio_fp32": 4 * PS.flops_per_s("fp32") / (2 * PS.egress),
        "ps.link_ratio_bf16": 2 * PS.flops_per_s("bf16") / (2 * PS.egress),
        "ex1.flops": g.flops,
        "ex1.tile512.down": tile512.down(),
        "ex1.tile512.up": tile512.up,
        "ex1.tile512.flops": tile512.flops,
        "ex1.tile512.memory": tile512.memory,
        "ex1.tile512.verify": tile512.verify_flops(),
        "ex1.laptop.tile512.down_s": lap512.down,
        "ex1.laptop.tile512.compute_s": lap512.compute,
        "ex1.laptop.tile512.up_s": lap512.up,
        "ex1.laptop.tile512.alone_s": pipeline([lap512], LAPTOP.rtt),
        "ex1.desktop.tile512.down_s": desk512.down,
        "ex1.desktop.tile512.compute_s": desk512.compute,
        "ex1.desktop.tile512.up_s": desk512.up,
        "ex1.desktop.tile512.alone_s": pipeline([desk512], DESKTOP.rtt),
        "ex1.tile128.down": tile128.down(),
        "ex1.tile128.up": tile128.up,
        "ex1.tile128.flops": tile128.flops,
        "ex1.tile128.verify": tile128.verify_flops(),
        "ex1.laptop.tile128.up_s": lap128.up,
        "ex1.desktop.tile128.up_s": desk128.up,
        "ex1.floor4": output_tiles_egress_floor(g.m, g.n, g.k, 4, g.itemsize),
        "ex1.uplink_floor_s": c_bytes / sum(c.count * c.profile.up for c in FLEET),
        "ex1.ingress_floor_s": c_bytes / PS.ingress,
        "ex1.local_s": local_seconds(g.m, g.n, g.k, g.dtype, PS),
        "ex1.verify_whole": whole.verify_flops(),
        "ex1.check_ratio": whole.verify_flops() / PS.verify_flops / local_seconds(g.m, g.n, g.k, g.dtype, PS),
        "ex1.baseline.grid": str(base.grid),
        "ex1.baseline.device_down": base.egress_bytes / 4,
        "ex1.baseline.egress": base.egress_bytes,
        "ex1.baseline.s": base.seconds,
        "ex1.baseline.desktop_s": _shares(base)["desktop"].seconds,
        "ex1.plan.kind": plan.kind.value,
        "ex1.plan.grid": str(plan.grid),
        "ex1.plan.bands": plan.bands,
        "ex1.plan.s": plan.seconds,
        "ex1.plan.bound": plan.bound,
        "ex1.plan.desktop.per_device": desk.per_device,
        "ex1.plan.desktop.down": desk.down_bytes,
        "ex1.plan.desktop.up": desk.up_bytes,
        "ex1.plan.laptop.per_device": lap.per_device,
        "ex1.plan.laptop.s": lap.seconds,
        "ex1.plan.laptop.down": lap.down_bytes,
        "ex1.plan.laptop.up": lap.up_bytes,
        "ex1.plan.desktop_device_down": desk.device_down,
        "ex1.plan.laptop_device_down": lap.device_down,
        "ex1.plan.desktop_rest_down": (desk.device_down - tile128.down()) / (desk.per_device - 1),
        "ex1.plan.desktop_fill_s": desk_fill,
        "ex1.plan.laptop_fill_s": lap_fill,
        "ex1.plan.laptop_31st_s": lap_fill + 31 * lap128.up,
        "ex1.plan.egress": plan.egress_bytes,
        "ex1.plan.egress_floor": plan.egress_floor,
        "ex1.plan.egress_s": plan.egress_bytes / PS.egress,
        "ex1.plan.ingress": plan.ingress_bytes,
        "ex1.plan.ps_s": plan.ps_seconds,
        "ex1.plan.units_s": plan.units * PS.unit_overhead,
        "ex1.plan.verify_s": plan.units * tile128.verify_flops() / PS.verify_flops,
        "ex1.plan.out_s": c_bytes / PS.memory_bw,
        "ex1.realized.egress": sum(realized.values()),
        "ex1.realized.desktop": _per_class(realized, "desktop"),
        "ex1.realized.laptop": _per_class(realized, "laptop"),
        "ex1.one_band.egress": one_band.egress_bytes,
        "ex1.speedup": base.seconds / plan.seconds,
        "ex1.plan512.s": plan512.seconds,
        "ex1.grid3d.s": only[Kind.GRID3D].seconds,
        "ex1.grid3d.ingress": only[Kind.GRID3D].ingress_bytes,
        "ex1.splitk.s": only[Kind.SPLIT_K].seconds,
        "ex2.flops": EX2.flops,
        "ex2.local_s": plan_gemm(EX2, FLEET, PS).seconds,
        "ex2.plan.kind": plan2.kind.value,
        "ex2.plan.grid": str(plan2.grid),
        "ex2.plan.s": plan2.seconds,
        "ex2.plan.desktop.per_device": _shares(plan2)["desktop"].per_device,
        "ex2.laptop_alone_s": pipeline([lap_tile2], LAPTOP.rtt),
        "ex2.baseline.s": baseline(EX2, FLEET, PS).seconds,
        "ex2.step_s": step.seconds,
        "ex3.flops": EX3.flops,
        "ex3.local_s": local_seconds(EX3.m, EX3.n, EX3.k, EX3.dtype, PS),
        "ex3.inputs_s": EX3.itemsize * (EX3.m * EX3.k + EX3.k * EX3.n) / PS.egress,
        "ex3.output_s": EX3.itemsize * EX3.m * EX3.n / PS.ingress,
        "ex3.plan.kind": plan3.kind.value,
        "ex3.plan.grid": str(plan3.grid),
        "ex3.plan.bands": plan3.bands,
        "ex3.plan.s": plan3.seconds,
        "ex3.plan.bound": plan3.bound,
        "ex3.plan.devices": plan3.devices,
        "ex3.plan.per_device": gpu3.per_device,
        "ex3.plan.device_down": gpu3.device_down,
        "ex3.plan.ps_s": plan3.ps_seconds,
        "ex3.plan.verify_s": plan3.units * tile3.verify_flops() / PS.verify_flops,
        "ex3.plan.egress_s": plan3.egress_bytes / PS.egress,
        "ex3.plan.units": plan3.units,
        "ex3.baseline.s": baseline(EX3, GPUS, PS).seconds,
        "ex3.speedup_local": local_seconds(EX3.m, EX3.n, EX3.k, EX3.dtype, PS) / plan3.seconds,
        "ex3.loop.s": plan_gemm(EX3, GPUS, WITH_LOOP).seconds,
        "ex3.loop.bound": plan_gemm(EX3, GPUS, WITH_LOOP).bound,
        "ex3.loop.units": plan_gemm(EX3, GPUS, WITH_LOOP).units,
        "ex3.loop.loop_s": plan_gemm(EX3, GPUS, WITH_LOOP).loop_seconds,
    }


def table() -> dict[str, str]:
    """The page's "Checked figures" table: figure name -> value as printed."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Checked figures", 1)[1]
    rows = re.findall(r"^\| `([\w.]+)` \| (.+?) \|$", section, flags=re.M)
    assert rows, "no checked figures found"
    return {name: value.strip() for name, value in rows}


def _matches(printed: str, value: object) -> bool:
    printed = printed.strip("`")
    if isinstance(value, str):
        return printed == value
    number = printed.replace(",", "")
    decimals = len(number.split(".")[1]) if "." in number else 0
    return abs(float(number) - float(value)) <= 0.5 * 10.0**-decimals * (1 + 1e-9) + 1e-12


def test_every_checked_figure_is_what_the_code_computes() -> None:
    printed, computed = table(), figures()
    assert sorted(printed) == sorted(computed), "the page's table and this test name different figures"
    wrong = {name: (printed[name], computed[name]) for name in computed if not _matches(printed[name], computed[name])}
    assert not wrong, f"docs/cost-model.md disagrees with the code (printed, computed): {wrong}"


def test_every_checked_figure_is_quoted_in_the_text() -> None:
    text = DOC.read_text(encoding="utf-8").split("## Checked figures", 1)[0]
    missing = [name for name, value in table().items() if value.strip("`") not in text]
    assert not missing, f"figures in the table but not in the text: {missing}"


@pytest.mark.parametrize("s", [Stage(1, 2, 3), Stage(5, 1, 1), Stage(0.3, 0.9, 0.2), Stage(0, 0, 0)])
@pytest.mark.parametrize("n", [1, 2, 7])
def test_the_steady_state_formula_of_the_page(s: Stage, n: int) -> None:
    # fill and drain once, then (n - 1) times the slowest stage, plus the round trip
    expected = s.total + (n - 1) * s.bottleneck + 0.05
    assert pipelined(s, s, n, 0.05) == pytest.approx(expected)
    assert pipeline([s] * n, 0.05) == pytest.approx(expected)


def test_the_first_example_is_upload_bound_as_derived_by_hand() -> None:
    plan = plan_gemm(EX1, FLEET, PS, NO_LOCAL)
    desk = stage(Unit(128, 128, 768, 4), DESKTOP, "fp32")
    # The desktop's time is its first tile's download and compute, 162 uploads and the round trip.
    assert plan.seconds == pytest.approx(desk.down + desk.compute + 162 * desk.up + DESKTOP.rtt)
    # The laptops' 60 tiles follow their share of the fleet's uplink within a few points.
    laptops = _shares(plan)["laptop"].pieces / 384
    assert laptops == pytest.approx(2 * LAPTOP.up / (2 * LAPTOP.up + 2 * DESKTOP.up), abs=0.02)
    # A run of n tiles in a band of 8 rows is charged 8 row blocks and 2 + (n - 2) / 8 column blocks.
    block = 128 * 768 * 4
    assert _shares(plan)["desktop"].device_down == (8 + 2 + 160 / 8) * block
    assert _shares(plan)["laptop"].device_down == (8 + 2 + 28 / 8) * block
    # With every kind allowed, the PS itself wins: k = 768 is below the link's 1600.
    assert plan_gemm(EX1, FLEET, PS).kind is Kind.LOCAL
    assert local_seconds(EX1.m, EX1.n, EX1.k, "fp32", PS) < EX1.itemsize * EX1.m * EX1.n / PS.ingress
    # What the units need <= what was priced; unequal shares need less than 4 equal ones, and the
    # plan's floor is a lower bound on both.
    realized = sum(_realized(plan).values())
    assert plan.egress_floor < realized < plan.egress_bytes
    assert plan.egress_floor < output_tiles_egress_floor(EX1.m, EX1.n, EX1.k, 4, EX1.itemsize)
    assert math.isclose(sum(s.pieces for s in plan.shares), 16 * 24)


def test_the_third_example_leaves_the_ps_as_derived_by_hand() -> None:
    plan = plan_gemm(EX3, GPUS, PS)
    gpu = _shares(plan)["gpu"]
    assert plan.kind is Kind.OUTPUT and (plan.grid, plan.bands) == ((2, 197, 1), 1)
    assert gpu.device_down == 2 * 2048 * (2 * 1024 + (2 + 25 / 2) * 256)
    first = Unit(1024, 256, 2048, 2).down()
    tile = stage(Unit(2048 / 2, 50272 / 197, 2048, 2), GPU, "bf16")
    # Upload-bound: the first tile's download and compute, 27 uploads, the round trip.
    assert (gpu.device_down - first) / 26 / GPU.down < tile.up
    assert plan.seconds == pytest.approx(first / GPU.down + tile.compute + 27 * tile.up + GPU.rtt)
    checks = 394 * Unit(1024, 50272 / 197, 2048, 2).verify_flops() / PS.verify_flops
    assert plan.ps_seconds == pytest.approx(394 * PS.unit_overhead + checks + 2 * 2048 * 50272 / PS.memory_bw)
    # More GPUs do not help: the PS's checks and egress are nearly saturated.
    assert plan_gemm(EX3, (DeviceClass("gpu", 64, GPU),), PS).seconds == pytest.approx(plan.seconds)


def test_checking_and_the_link_cost_what_the_page_says_relative_to_computing() -> None:
    # 32 (mk + kn + mn) FLOP at 200 GFLOP/s against 2 mnk at 1000 GFLOP/s: 80 (1/m + 1/n + 1/k).
    for m, n, k in [(2048, 3072, 768), (240, 240, 240), (512, 352, 64)]:
        ratio = Unit(m, n, k).verify_flops() / PS.verify_flops / local_seconds(m, n, k, "fp32", PS)
        assert ratio == pytest.approx(80 * (1 / m + 1 / n + 1 / k))
    # ... and every fleet plan checks at least the whole product once, and moves every input and
    # output once: s (mk + kn) / egress and s mn / ingress, 1600 (1/m + 1/n) and 1600 / k times
    # computing in fp32.
    for kind in (Kind.OUTPUT, Kind.SPLIT_K, Kind.GRID3D):
        plan = plan_gemm(EX1, FLEET, PS, PlannerOptions(kinds=frozenset({kind})))
        assert plan.ps_seconds >= Unit(EX1.m, EX1.n, EX1.k).verify_flops() / PS.verify_flops
        assert plan.seconds >= max(4 * (EX1.m * EX1.k + EX1.k * EX1.n) / PS.egress, 4 * EX1.m * EX1.n / PS.ingress)
    local = local_seconds(EX1.m, EX1.n, EX1.k, "fp32", PS)
    assert 4 * EX1.m * EX1.n / PS.ingress / local == pytest.approx(1600 / EX1.k)
    assert 4 * (EX1.m * EX1.k + EX1.k * EX1.n) / PS.egress / local == pytest.approx(1600 * (1 / EX1.m + 1 / EX1.n))
