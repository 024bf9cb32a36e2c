"""The simulator's energy books (coordinator/whatif/energy.py): the pure model against figures
worked by hand, its invariants, the DTFM placement's assignment, and ``cleave simulate``'s JSON."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
from typer.testing import CliRunner

from cleave.cli.app import app
from cleave.coordinator.engine.energy import GRID_GCO2_KWH, J_PER_KWH
from cleave.coordinator.planning.costmodel import CostModelError, DeviceClass, Profile
from cleave.coordinator.whatif import energy
from cleave.coordinator.whatif.baselines import cloud_step, dtfm_step, step_flops
from cleave.coordinator.whatif.energy import (
    DEVICE_POWER,
    NETWORK_J_PER_BYTE,
    PUE_DEFAULT,
    STANDBY_W,
    cleave_energy,
    cloud_energy,
    device_power,
    dtfm_energy,
)
from cleave.coordinator.whatif.presets import FLEETS, model_shape, resolve_fleet

RUNNER = CliRunner()
FAST = ["--model", "small", "--fleet", "laptops", "--ps-gflops", "2", "--batch-size", "2", "--seq-len", "64"]


def _cls(name: str, count: int = 1, fp32: float = 100.0) -> DeviceClass:
    return DeviceClass(name, count, Profile(gflops={"fp32": fp32}, memory=1 << 33, down=1e7, up=1e6, rtt=0.02))


def test_every_preset_class_has_a_power_with_busy_above_idle_and_a_source() -> None:
    names = {cls.name for classes in FLEETS.values() for cls in classes}
    assert names <= set(DEVICE_POWER)
    for name, power in DEVICE_POWER.items():
        assert power.busy_w > power.idle_w > 0, name
        assert power.source, name


def test_desktop_gpus_are_board_plus_host_through_the_power_supply() -> None:
    # RTX 4090: (450 W board + 60 W host) / 0.87 at the wall.
    assert DEVICE_POWER["rtx-4090"].busy_w == pytest.approx(510 / 0.87)
    assert DEVICE_POWER["rtx-3060"].idle_w == pytest.approx(50 / 0.87)


def test_network_figure_is_aslan_2015_halved_every_two_years_to_2023() -> None:
    # 0.06 kWh/GB / 2^4 = 0.00375 kWh/GB = 13.5 kJ/GB.
    assert NETWORK_J_PER_BYTE * 1e9 == pytest.approx(13_500)


def test_cleave_step_matches_a_hand_computed_figure() -> None:
    # Prepare: 2 laptop-low (25 W busy, 5 W idle) present 10 s each, busy 4 s in all; a server
    # coordinator (500 W) at PUE 1.5 for the 10 s step; 1 GB moved.
    fleet = (_cls("laptop-low", 2),)
    # Execute
    e = cleave_energy(
        fleet,
        {"laptop-low": 4.0},
        {"laptop-low": 20.0},
        10.0,
        coordinator_w=500.0,
        pue=1.5,
        flops=2e12,
        network_bytes=1e9,
    )
    # Assert: busy 4 x 25 = 100 J; waiting 16 x 5 = 80 J; coordinator 500 x 1.5 x 10 = 7,500 J.
    assert e.devices_busy_j == pytest.approx(100)
    assert e.devices_waiting_j == pytest.approx(80)
    assert e.datacentre_j == pytest.approx(7500)
    assert e.energy_j == pytest.approx(7680)
    assert e.j_per_gflop == pytest.approx(7680 / 2000)
    assert e.co2_g == pytest.approx(7680 / J_PER_KWH * GRID_GCO2_KWH)
    assert e.network_j == pytest.approx(13_500)  # apart: not in energy_j
    row = e.as_json()["by_class"]["laptop-low"]
    assert row == {
        "busy_s": 4.0,
        "waiting_s": 16.0,
        "standby_s": 0.0,
        "busy_j": 100.0,
        "waiting_j": 80.0,
        "standby_j": 0.0,
        "increment_j": 80.0,
    }
    # On the increment over machines on anyway: busy 4 x (25 - 5) = 80 J, waiting nothing, the
    # coordinator whole.
    assert e.devices_increment_j == pytest.approx(80)
    assert e.increment_j == pytest.approx(7580)
    assert e.as_json()["increment_j_per_gflop"] == pytest.approx(7580 / 2000)


def test_standby_seconds_cost_standby_power_whole_and_nothing_on_the_increment() -> None:
    # Prepare: 2 laptop-low (25 W busy, 5 W idle) present 20 s in all, busy 4 s, asleep 10 s;
    # a tier's rank standing for 3 such shares; no coordinator.
    fleet = (_cls("laptop-low", 2),)
    # Execute
    e = cleave_energy(
        fleet, {"laptop-low": 4.0}, {"laptop-low": 20.0}, 10.0, coordinator_w=0.0, scale=3.0,
        standby_s={"laptop-low": 10.0},
    )  # fmt: skip
    # Assert: x3: busy 12 s x 25 = 300 J; standby 30 s x 0.5 W = 15 J; awake waiting 18 s x 5 = 90 J.
    assert STANDBY_W == 0.5
    assert (e.devices_busy_j, e.devices_standby_j, e.devices_waiting_j) == pytest.approx((300, 15, 90))
    assert e.energy_j == pytest.approx(405)
    assert e.increment_j == pytest.approx(12 * 20)  # only computing adds to a machine on anyway
    row = e.by_class["laptop-low"]
    assert (row["standby_s"], row["waiting_s"]) == pytest.approx((30, 18))
    # Standby never takes more than the time present and not computing.
    over = cleave_energy(fleet, {"laptop-low": 4.0}, {"laptop-low": 20.0}, 10.0, coordinator_w=0.0,
                         standby_s={"laptop-low": 50.0})  # fmt: skip
    assert over.by_class["laptop-low"]["standby_s"] == 16.0 and over.devices_waiting_j == 0.0
    with pytest.raises(CostModelError, match="standby seconds"):
        cleave_energy(fleet, {}, {}, 1.0, coordinator_w=0.0, standby_s={"laptop-low": -1.0})
    with pytest.raises(CostModelError, match="not in the fleet"):
        cleave_energy(fleet, {}, {}, 1.0, coordinator_w=0.0, standby_s={"rtx-4090": 1.0})


def test_the_increment_is_never_above_the_whole_draw_nor_below_zero() -> None:
    rng = random.Random(11)
    fleet = tuple(_cls(name, 3) for name in ("phone-mid", "apple-m1", "rtx-4090"))
    for _ in range(50):
        step = rng.uniform(0.1, 100)
        busy = {c.name: rng.uniform(0, 3 * step) for c in fleet}
        standby = {c.name: rng.uniform(0, 3 * step) for c in fleet}
        e = cleave_energy(fleet, busy, {c.name: 3 * step for c in fleet}, step, coordinator_w=500.0,
                          standby_s=standby)  # fmt: skip
        assert e.datacentre_j <= e.increment_j <= e.energy_j
        for row in e.by_class.values():
            assert 0 <= row["increment_j"] <= row["busy_j"]


def test_a_tier_counts_its_coordinators_relays_and_every_share_of_the_fleet() -> None:
    fleet = (_cls("phone-mid", 4),)
    one = cleave_energy(fleet, {"phone-mid": 1.0}, {"phone-mid": 4.0}, 1.0, coordinator_w=500.0, pue=1.0)
    tier = cleave_energy(
        fleet,
        {"phone-mid": 1.0},
        {"phone-mid": 4.0},
        1.0,
        coordinator_w=500.0,
        coordinators=4,
        relays=2,
        pue=1.0,
        scale=4.0,
    )
    assert tier.devices_j == pytest.approx(4 * one.devices_j)
    assert tier.datacentre_j == pytest.approx(4 * (500 + 2 * energy.RELAY_W))


def test_energy_is_at_least_the_busy_floor_and_grows_with_the_step() -> None:
    rng = random.Random(7)
    fleet = tuple(_cls(name, 3) for name in ("phone-flagship", "laptop-high", "rtx-3080"))
    for _ in range(50):
        step = rng.uniform(0.1, 100)
        busy = {c.name: rng.uniform(0, 3 * step) for c in fleet}
        present = {c.name: 3 * step for c in fleet}
        e = cleave_energy(fleet, busy, present, step, coordinator_w=500.0)
        floor = sum(busy[c.name] * DEVICE_POWER[c.name].busy_w for c in fleet)
        assert e.energy_j >= floor
        longer = cleave_energy(fleet, busy, {k: 6 * step for k in present}, 2 * step, coordinator_w=500.0)
        assert longer.energy_j > e.energy_j


def test_cloud_with_pue_one_is_board_plus_host_over_its_step() -> None:
    model = model_shape("llama2-7b")
    for gpu, board, node in (("a100-80gb", 400, 6500), ("h100-80gb", 700, 10200)):
        cloud = cloud_step(model, 8, 256, "bf16", gpu=gpu)
        e = cloud_energy(cloud, pue=1.0)
        # 8 GPUs: 8 boards plus the rest of the node's maximum = the node's maximum.
        assert e.energy_j == pytest.approx(node * cloud.step_s)
        assert energy.CLOUD_POWER[gpu].board_w == board
        assert cloud_energy(cloud).energy_j == pytest.approx(PUE_DEFAULT * node * cloud.step_s)
        assert e.increment_j == e.energy_j  # dedicated machines: whole both ways
        assert e.j_per_gflop == pytest.approx(node / (cloud.gpus * cloud.peak_tflops * 1e3 * cloud.utilisation))


def test_bad_inputs_are_refused_in_one_line() -> None:
    fleet = (_cls("laptop-low"),)
    with pytest.raises(CostModelError, match="PUE is at least 1"):
        cleave_energy(fleet, {}, {}, 1.0, coordinator_w=1.0, pue=0.9)
    with pytest.raises(CostModelError, match="not in the fleet"):
        cleave_energy(fleet, {"laptop-high": 1.0}, {}, 1.0, coordinator_w=1.0)
    with pytest.raises(CostModelError, match="finite"):
        cleave_energy(fleet, {}, {}, math.nan, coordinator_w=1.0)


def test_a_fleet_files_class_takes_the_nearest_presets_power_and_says_so() -> None:
    power, estimated = device_power(_cls("my-gpu", fp32=45_000.0))
    assert estimated and power == DEVICE_POWER["rtx-4090"]
    power, estimated = device_power(_cls("laptop-low"))
    assert not estimated and power == DEVICE_POWER["laptop-low"]


def _brute(supply: list[int], demand: list[int], cost: list[list[float | None]]) -> float:
    best = math.inf
    ranges = [range(min(supply[c], demand[s]) + 1) for c in range(len(supply)) for s in range(len(demand))]
    for flat in itertools.product(*ranges):
        f = [flat[c * len(demand) : (c + 1) * len(demand)] for c in range(len(supply))]
        if any(sum(f[c]) > supply[c] for c in range(len(supply))):
            continue
        if any(sum(f[c][s] for c in range(len(supply))) != demand[s] for s in range(len(demand))):
            continue
        if any(f[c][s] and cost[c][s] is None for c in range(len(supply)) for s in range(len(demand))):
            continue
        best = min(best, sum(f[c][s] * (cost[c][s] or 0) for c in range(len(supply)) for s in range(len(demand))))
    return best


def test_the_placement_is_the_cheapest_assignment_on_random_small_cases() -> None:
    rng = random.Random(3)
    checked = 0
    for _ in range(120):
        n, m = rng.randint(1, 3), rng.randint(1, 3)
        supply = [rng.randint(0, 3) for _ in range(n)]
        demand = [rng.randint(0, 2) for _ in range(m)]
        cost = [[None if rng.random() < 0.25 else rng.uniform(0, 10) for _ in range(m)] for _ in range(n)]
        best = _brute(supply, demand, cost)
        if best == math.inf:
            continue
        flow = energy._assign(supply, demand, cost)
        assert [sum(flow[c][s] for c in range(n)) for s in range(m)] == demand
        assert all(sum(flow[c]) <= supply[c] for c in range(n))
        assert sum(flow[c][s] * (cost[c][s] or 0) for c in range(n) for s in range(m)) == pytest.approx(best)
        checked += 1
    assert checked > 50


def test_dtfm_energy_counts_the_devices_it_uses_busy_and_waiting_over_its_step() -> None:
    model = model_shape("llama2-7b")
    fleet = resolve_fleet("mixed", "fp32", 1000)
    r = dtfm_step(model, fleet, 8, 256, "fp32")
    e = dtfm_energy(r, fleet, "fp32", flops=step_flops(model, 8, 256))
    assert e is not None and r.step_s is not None
    assert sum(row["devices"] for row in e.by_class.values()) == r.devices_used
    assert sum(row["busy_s"] + row["waiting_s"] for row in e.by_class.values()) == pytest.approx(
        r.devices_used * r.step_s
    )
    # Every FLOP of the pipeline's stages is computed by some device at its class's rate.
    rates = {c.name: c.profile.flops_per_s("fp32") for c in fleet}
    computed = sum(row["busy_s"] * rates[name] for name, row in e.by_class.items())
    assert computed == pytest.approx(sum(seat.devices * seat.flops for seat in r.seats))
    assert e.datacentre_j == 0 and e.network_j > 0
    # Its devices are volunteers' too: on the increment, busy minus idle power while computing.
    assert e.devices_increment_j == pytest.approx(
        sum(row["busy_s"] * DEVICE_POWER[name].increment_w for name, row in e.by_class.items())
    )
    assert 0 < e.increment_j == e.devices_increment_j < e.energy_j
    phones = resolve_fleet("phones", "fp32", 100)
    assert dtfm_energy(dtfm_step(model, phones, 8, 256, "fp32"), phones, "fp32") is None  # does not fit


def test_simulate_json_carries_energy_for_cleave_and_both_baselines() -> None:
    result = RUNNER.invoke(app, ["simulate", *FAST, "--devices", "12", "--micro-batches", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["energy_assumptions"]["grid_gco2_kwh"] == GRID_GCO2_KWH
    assert report["energy_assumptions"]["pue"] == PUE_DEFAULT
    for system in ("cleave", "dtfm", "cloud"):
        e = report[system]["energy"]
        for key in ("energy_j", "kwh", "co2_g", "energy_j_per_gflop"):
            assert e[key] > 0, (system, key)
        assert e["energy_j"] == pytest.approx(e["devices_j"] + e["datacentre_j"])
        assert e["increment_j"] == pytest.approx(e["devices_increment_j"] + e["datacentre_j"])
        assert 0 < e["increment_j"] <= e["energy_j"], system
    c = report["cleave"]["energy"]
    assert c["devices_busy_j"] > 0 and c["devices_waiting_j"] > 0 and c["datacentre_j"] > 0
    assert set(c["by_class"]) == {"laptop-low", "laptop-high", "laptop-zen4"}
    ratio = report["energy_ratio"]["vs_cloud"]
    assert ratio == pytest.approx(report["cloud"]["energy"]["energy_j"] / c["energy_j"])
    ratio = report["energy_ratio"]["increment_vs_dtfm"]
    assert ratio == pytest.approx(report["dtfm"]["energy"]["increment_j"] / c["increment_j"])
    assert report["energy_assumptions"]["standby_w"] == STANDBY_W
    # The grid and the PUE are the caller's to state.
    again = RUNNER.invoke(
        app,
        [
            "simulate",
            *FAST,
            "--devices",
            "12",
            "--micro-batches",
            "1",
            "--grid-gco2-kwh",
            "0",
            "--pue",
            "1.58",
            "--json",
        ],
    )
    assert again.exit_code == 0, again.output
    other = json.loads(again.stdout)
    assert other["cleave"]["energy"]["co2_g"] == 0
    assert other["cloud"]["energy"]["energy_j"] == pytest.approx(
        report["cloud"]["energy"]["energy_j"] * 1.58 / PUE_DEFAULT
    )


def test_simulate_refuses_a_pue_below_one_and_prints_the_energy_table() -> None:
    bad = RUNNER.invoke(app, ["simulate", *FAST, "--devices", "4", "--pue", "0.5"])
    assert bad.exit_code == 2 and "--pue" in bad.output
    text = RUNNER.invoke(app, ["simulate", *FAST, "--devices", "4", "--micro-batches", "1"], terminal_width=200)
    assert text.exit_code == 0, text.output
    assert "energy per step" in text.output and "gCO2e" in text.output and "increment" in text.output
