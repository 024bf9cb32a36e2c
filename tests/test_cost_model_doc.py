"""docs/cost-model.md's worked examples, recomputed with the code: the page cannot drift from it.

Every figure of the page's "Checked figures" table is computed here from the examples' inputs
(coordinator/costmodel.py, coordinator/planner.py) and compared to the digits the page prints;
each figure must also be quoted in the page's text, not only in the table.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path

import pytest

from coordinator.costmodel import (
    DeviceClass, Profile, PSProfile, Stage, Unit, local_seconds, output_tiles_egress_floor, pipeline, pipelined,
    stage,
)
from coordinator.planner import Gemm, Kind, PlannerOptions, baseline, plan_gemm, plan_step, realize
from coordinator.presets import model_shape, step_gemms

DOC = Path(__file__).resolve().parent.parent / "docs" / "cost-model.md"
GIB = 1 << 30

# The examples' inputs, as the page states them.
LAPTOP = Profile({"fp32": 100.0, "bf16": 2.0}, memory=4 * GIB, down=200e6 / 8, up=20e6 / 8, rtt=0.04)
DESKTOP = Profile({"fp32": 1000.0, "bf16": 2000.0}, memory=8 * GIB, down=1e9 / 8, up=100e6 / 8, rtt=0.02)
FLEET = (DeviceClass("laptop", 2, LAPTOP), DeviceClass("desktop", 2, DESKTOP))
PS = PSProfile.from_link(10.0)
NO_LOCAL = PlannerOptions(kinds=frozenset(Kind) - {Kind.LOCAL})
EX1 = Gemm(2048, 3072, 768, "fp32", "fwd")  # A 2048 x 768, B 768 x 3072
EX1_BF16 = Gemm(2048, 3072, 768, "bf16", "fwd")
EX2 = Gemm(512, 352, 64, "fp32", "fwd")  # tiny's gate_up forward on 8 x 64 tokens


def _shares(plan) -> dict:
    return {s.name: s for s in plan.shares}


def _realized_egress(plan) -> int:
    """Bytes the realised units download: each distinct block once per device."""
    blocks: dict[tuple[str, int], set] = defaultdict(set)
    for u in realize(plan):
        blocks[(u.owner, u.device)] |= {("a", u.r0, u.r1, u.k0, u.k1), ("b", u.k0, u.k1, u.c0, u.c1)}
    s = plan.gemm.itemsize
    return sum(s * (b[2] - b[1]) * (b[4] - b[3]) for held in blocks.values() for b in held)


def figures() -> dict[str, object]:
    g = EX1
    tile512, tile128 = Unit(512, 512, 768, 4), Unit(128, 128, 768, 4)
    lap512, desk512 = stage(tile512, LAPTOP, "fp32"), stage(tile512, DESKTOP, "fp32")
    lap128, desk128 = stage(tile128, LAPTOP, "fp32"), stage(tile128, DESKTOP, "fp32")
    c_bytes = g.itemsize * g.m * g.n
    base = baseline(g, FLEET, PS)
    plan = plan_gemm(g, FLEET, PS, NO_LOCAL)
    by = _shares(plan)
    desk, lap = by["desktop"], by["laptop"]
    region = desk.down_bytes / desk.devices
    desk_fill = desk128.down + desk128.compute + DESKTOP.rtt
    lap_fill = lap128.down + lap128.compute + LAPTOP.rtt
    only = {kind: plan_gemm(g, FLEET, PS, PlannerOptions(kinds=frozenset({kind}))) for kind in (Kind.GRID3D, Kind.SPLIT_K)}
    plan512 = plan_gemm(g, FLEET, PS, PlannerOptions(kinds=frozenset({Kind.OUTPUT}), edges=(512,)))

    bf16 = plan_gemm(EX1_BF16, FLEET, PS)
    plan2 = plan_gemm(EX2, FLEET, PS, NO_LOCAL)
    rows, cols, _ = plan2.grid
    lap_tile2 = stage(Unit(EX2.m / rows, EX2.n / cols, EX2.k, 4), LAPTOP, "fp32")
    tiny = model_shape("tiny")
    step = plan_step([(Gemm(x.m, x.n, x.k, "fp32", x.kind), x.count) for x in step_gemms(tiny, 8, 64)], FLEET, PS)
    assert all(p.kind is Kind.LOCAL for p, _ in step.plans) and len(step.plans) == 15

    return {
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
        "ex1.local_s": local_seconds(g.m, g.n, g.k, g.dtype, PS),
        "ex1.verify_whole": Unit(g.m, g.n, g.k, g.itemsize).verify_flops(),
        "ex1.check_ratio": Unit(g.m, g.n, g.k, g.itemsize).verify_flops() / PS.verify_flops
        / local_seconds(g.m, g.n, g.k, g.dtype, PS),
        "ex1.baseline.grid": str(base.grid),
        "ex1.baseline.device_down": base.egress_bytes / 4,
        "ex1.baseline.egress": base.egress_bytes,
        "ex1.baseline.s": base.seconds,
        "ex1.baseline.desktop_s": _shares(base)["desktop"].seconds,
        "ex1.plan.kind": plan.kind.value,
        "ex1.plan.grid": str(plan.grid),
        "ex1.plan.s": plan.seconds,
        "ex1.plan.bound": plan.bound,
        "ex1.plan.desktop.per_device": desk.per_device,
        "ex1.plan.desktop.down": desk.down_bytes,
        "ex1.plan.desktop.up": desk.up_bytes,
        "ex1.plan.laptop.per_device": lap.per_device,
        "ex1.plan.laptop.s": lap.seconds,
        "ex1.plan.laptop.down": lap.down_bytes,
        "ex1.plan.laptop.up": lap.up_bytes,
        "ex1.plan.desktop_region": region,
        "ex1.plan.laptop_region": lap.down_bytes / lap.devices,
        "ex1.plan.desktop_rest_down": (region - tile128.down()) / (desk.per_device - 1),
        "ex1.plan.desktop_fill_s": desk_fill,
        "ex1.plan.laptop_fill_s": lap_fill,
        "ex1.plan.laptop_31st_s": lap_fill + 31 * lap128.up,
        "ex1.plan.egress": plan.egress_bytes,
        "ex1.plan.egress_floor": plan.egress_floor,
        "ex1.plan.egress_s": plan.egress_bytes / PS.egress,
        "ex1.plan.ingress": plan.ingress_bytes,
        "ex1.plan.ingress_s": plan.ingress_bytes / PS.ingress,
        "ex1.plan.ps_s": plan.ps_seconds,
        "ex1.plan.units_s": plan.units * PS.unit_overhead,
        "ex1.plan.verify_s": plan.units * tile128.verify_flops() / PS.verify_flops,
        "ex1.plan.out_s": c_bytes / PS.memory_bw,
        "ex1.speedup": base.seconds / plan.seconds,
        "ex1.plan512.s": plan512.seconds,
        "ex1.grid3d.s": only[Kind.GRID3D].seconds,
        "ex1.grid3d.ingress": only[Kind.GRID3D].ingress_bytes,
        "ex1.splitk.s": only[Kind.SPLIT_K].seconds,
        "ex1.realized_egress": _realized_egress(plan),
        "ex1b.local_s": local_seconds(g.m, g.n, g.k, "bf16", PS),
        "ex1b.plan.kind": bf16.kind.value,
        "ex1b.plan.grid": str(bf16.grid),
        "ex1b.plan.s": bf16.seconds,
        "ex1b.plan.bound": bf16.bound,
        "ex1b.baseline.s": baseline(EX1_BF16, FLEET, PS).seconds,
        "ex2.flops": EX2.flops,
        "ex2.local_s": plan_gemm(EX2, FLEET, PS).seconds,
        "ex2.plan.kind": plan2.kind.value,
        "ex2.plan.grid": str(plan2.grid),
        "ex2.plan.s": plan2.seconds,
        "ex2.plan.desktop.per_device": _shares(plan2)["desktop"].per_device,
        "ex2.laptop_alone_s": pipeline([lap_tile2], LAPTOP.rtt),
        "ex2.baseline.s": baseline(EX2, FLEET, PS).seconds,
        "ex2.step_s": step.seconds,
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
    # With every kind allowed, the PS itself wins: 2 k / s FLOP per byte up cannot keep up with it.
    assert plan_gemm(EX1, FLEET, PS).kind is Kind.LOCAL
    assert 2 * EX1.k / EX1.itemsize * 30e6 < PS.flops_per_s("fp32")
    # Equal shares of 4 devices bound the egress from below; these unequal shares need less.
    assert plan.egress_bytes == pytest.approx(plan.egress_floor)
    assert plan.egress_bytes < output_tiles_egress_floor(EX1.m, EX1.n, EX1.k, 4, EX1.itemsize)
    assert math.isclose(sum(s.pieces for s in plan.shares), 16 * 24)


def test_checking_costs_what_the_page_says_relative_to_computing() -> None:
    # 32 (mk + kn + mn) FLOP at 5 GFLOP/s against 2 mnk at 100 GFLOP/s: 320 (1/m + 1/n + 1/k).
    for m, n, k in [(2048, 3072, 768), (960, 960, 960), (512, 352, 64)]:
        ratio = Unit(m, n, k).verify_flops() / PS.verify_flops / local_seconds(m, n, k, "fp32", PS)
        assert ratio == pytest.approx(320 * (1 / m + 1 / n + 1 / k))
    # ... and every fleet plan checks at least the whole product once.
    for kind in (Kind.OUTPUT, Kind.SPLIT_K, Kind.GRID3D):
        plan = plan_gemm(EX1, FLEET, PS, PlannerOptions(kinds=frozenset({kind})))
        assert plan.ps_seconds >= Unit(EX1.m, EX1.n, EX1.k).verify_flops() / PS.verify_flops
