"""Energy and carbon (issue 23): the meters against fake counters, the books' band, the Core's
handling of reports, and a real coordinator with real clients whose RAPL counters are fakes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from cleave.coordinator.engine.energy import (
    BEST_GFLOP_PER_J,
    CEILING_W,
    CPU_PEAK_GFLOPS,
    GRID_GCO2_KWH,
    IDLE_W,
    EnergyBooks,
    grams,
    kind_of,
)
from cleave.meters import WATTS_PER_CORE, EnergyMeter, Rapl
from cleave.wire.codes import EnergySource
from cleave.wire.messages import Energy

# --------------------------------------------------------------------------- fake sysfs


def _zone(root: Path, name: str, label: str, uj: int, top: int = 262_143_328_850) -> Path:
    zone = root / name
    zone.mkdir(parents=True)
    (zone / "name").write_text(label + "\n")
    (zone / "max_energy_range_uj").write_text(f"{top}\n")
    (zone / "energy_uj").write_text(f"{uj}\n")
    return zone / "energy_uj"


def _battery(root: Path, energy_uwh: int, status: str) -> Path:
    cell = root / "BAT0"
    cell.mkdir(parents=True, exist_ok=True)
    (cell / "status").write_text(status + "\n")
    (cell / "energy_now").write_text(f"{energy_uwh}\n")
    return cell


class Clock:
    def __init__(self) -> None:
        self.t, self.cpu = 100.0, 5.0

    def __call__(self) -> float:
        return self.t


def test_rapl_sums_the_package_counters_and_adds_back_a_wrap(tmp_path: Path) -> None:
    """Two packages (their subzones and the platform zone are not added again); a counter that
    wraps between reads is added back from its range."""
    root = tmp_path / "powercap"
    pkg0 = _zone(root, "intel-rapl:0", "package-0", 1_000_000, top=10_000_000)
    pkg1 = _zone(root, "intel-rapl:1", "package-1", 5_000_000)
    _zone(root, "intel-rapl:0:0", "core", 123)  # a subzone: inside package 0
    _zone(root, "intel-rapl:2", "psys", 999)  # the platform: it holds the packages
    rapl = Rapl(root)
    assert len(rapl.zones) == 2 and rapl.read() == 0.0
    pkg0.write_text("9000000\n")  # +8 J
    pkg1.write_text("7000000\n")  # +2 J
    assert rapl.read() == pytest.approx(10.0)
    pkg0.write_text("500000\n")  # wrapped at 10 J: +1.5 J
    assert rapl.read() == pytest.approx(11.5)


def test_without_readable_counters_the_meter_says_why_and_estimates(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "powercap"
    _zone(root, "intel-rapl:0", "package-0", 1)

    def denied(self: Path, *args: object, **kwargs: object) -> str:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", denied)
    rapl = Rapl(root)
    monkeypatch.undo()
    assert not rapl and "readable only by root" in rapl.why_not
    clock = Clock()
    meter = EnergyMeter(
        powercap=tmp_path / "none", power_supply=tmp_path / "none", cpu_seconds=lambda: clock.cpu, clock=clock
    )
    assert "estimate" in meter.describe() and "no RAPL counters" in meter.describe()
    clock.t, clock.cpu = 130.0, 17.0  # 12 CPU seconds over 30 s
    span = meter.span()
    assert span.source is EnergySource.ESTIMATE and span.seconds == 30.0
    assert span.joules == pytest.approx(12 * WATTS_PER_CORE) and span.gpu_joules == 0.0


def test_the_meter_takes_rapl_first_then_a_discharging_battery_and_adds_the_gpu(tmp_path: Path) -> None:
    clock = Clock()
    counter = _zone(tmp_path / "powercap", "intel-rapl:0", "package-0", 0)
    gpu = [1000.0]
    meter = EnergyMeter(
        powercap=tmp_path / "powercap", power_supply=tmp_path / "ps", cpu_seconds=lambda: clock.cpu,
        clock=clock, nvml=lambda: gpu[0],
    )  # fmt: skip
    counter.write_text("42000000\n")
    gpu[0] += 300.0
    clock.t += 10
    span = meter.span()
    assert (span.source, span.joules, span.gpu_joules, span.total) == (EnergySource.RAPL, 42.0, 300.0, 342.0)
    assert "RAPL" in meter.describe() and "NVML" in meter.describe()
    # No RAPL: the battery, while it discharges for the whole span.
    cell = _battery(tmp_path / "ps", 50_000_000, "Discharging")
    meter = EnergyMeter(
        powercap=tmp_path / "no", power_supply=tmp_path / "ps", cpu_seconds=lambda: clock.cpu, clock=clock
    )
    (cell / "energy_now").write_text("49990000\n")  # 10,000 µWh = 36 J
    span = meter.span()
    assert span.source is EnergySource.BATTERY and span.joules == pytest.approx(36.0)
    (cell / "status").write_text("Charging\n")  # plugged in: the battery says nothing of the machine
    clock.cpu += 2.0
    span = meter.span()
    assert span.source is EnergySource.ESTIMATE and span.joules == pytest.approx(2 * WATTS_PER_CORE)


# --------------------------------------------------------------------------- the books


def test_the_books_believe_a_claim_within_its_band_and_cap_and_flag_one_outside() -> None:
    books = EnergyBooks(grid_gco2_kwh=400.0)
    books.joined(1, "cpu", 0.0)
    books.joined(2, "cuda:0", 0.0)
    # 30 s at 100 W, 90 GFLOP verified: believed, as RAPL, at the volunteer's own grid.
    claim = books.claim(1, Energy(3000.0, 30.0, EnergySource.RAPL, grid_gco2_kwh=100.0), 90.0, held=30.0)
    assert claim.booked == {EnergySource.RAPL: 3000.0} and not claim.flagged and claim.gflop == 90.0
    assert claim.grams == pytest.approx(grams(3000.0, 100.0))
    # A GPU device: the board's NVML figure is booked under its own source.
    claim = books.claim(2, Energy(600.0, 30.0, EnergySource.ESTIMATE, gpu_joules=9000.0), 0.0, held=30.0)
    assert claim.booked == {EnergySource.ESTIMATE: 600.0, EnergySource.NVML: 9000.0}
    # Over its kind's ceiling: 40 s holding work (+5 s once) at 350 W is the most over its
    # connection, 3,000 J of which are booked already; capped at the rest, flagged.
    claim = books.claim(1, Energy(1e6, 10.0, EnergySource.RAPL), 90.0, held=40.0)
    assert claim.flagged and claim.booked == {EnergySource.CAPPED: pytest.approx(45 * 350 - 3000)}
    # Too efficient to be true: 5,000 GFLOP more for 1 J on a CPU (at most 50 GFLOP/J over the
    # connection: 5,090 GFLOP need 101.8 J, and far more is booked already: believed).
    claim = books.claim(1, Energy(1.0, 10.0, EnergySource.ESTIMATE), 5090.0, held=50.0)
    assert not claim.flagged and claim.gflop == 5000.0
    # A device may not claim the coordinator's sources.
    with pytest.raises(ValueError, match="rapl, battery, estimate"):
        books.claim(1, Energy(1.0, 1.0, EnergySource.CAPPED), 5090.0, held=51.0)
    with pytest.raises(ValueError, match="not metered"):
        books.claim(9, Energy(1.0, 1.0, EnergySource.RAPL), 0.0, held=51.0)
    assert books.flagged == 1 and books.devices[1].flagged == 1
    books.own(500.0, EnergySource.ESTIMATE)
    step = books.close_step(gflop=5090.0)
    assert step.flagged == 1 and step.coordinator_j == 500.0
    assert step.devices_j == pytest.approx(3000 + 9600 + (45 * 350 - 3000) + 1)
    assert step.j_per_gflop == pytest.approx(step.joules / 5090.0)
    assert (
        step.sources["capped"] == pytest.approx(45 * 350 - 3000) and step.sources["estimate"] == 1101.0
    )  # both devices and the coordinator
    row = step.as_row()
    assert row["energy_flagged"] == 1 and row["j_coordinator"] == 500.0
    # The next step starts empty; the job's summary keeps it all.
    assert books.close_step(gflop=5090.0).joules == 0.0
    summary = books.summary(5090.0)
    assert summary["joules"] == pytest.approx(step.joules) and summary["flagged"] == 1
    assert summary["coordinator_sources"] == {"estimate": 500.0}
    assert kind_of("mps") == "mps" and kind_of("npu") == "cpu" and GRID_GCO2_KWH == 436.0
    with pytest.raises(ValueError, match="grid"):
        EnergyBooks(grid_gco2_kwh=-1.0)


def test_no_way_of_cutting_reports_widens_the_band() -> None:
    """Many reports a second get the slack once, not each (and no more of it than the seconds it
    held work); the floor holds over the connection (a device that reported nothing while it
    verified work cannot book 1 J for it later)."""
    books = EnergyBooks()
    books.joined(1, "cpu", 0.0)
    booked = sum(
        sum(books.claim(1, Energy(5000.0, 0.01, EnergySource.RAPL), 0.0, held=0.01 * i).booked.values())
        for i in range(1, 301)
    )  # 300 reports in 3 s, each claiming 5 kJ
    assert booked == pytest.approx((3.0 + 3.0) * 350.0)  # 3 s holding work, as much slack once, at 350 W
    books.joined(2, "cpu", 0.0)
    claim = books.claim(2, Energy(1e-9, 100.0, EnergySource.RAPL), 10_000.0, held=100.0)  # 10 TFLOP for nothing
    assert claim.flagged and claim.booked == {EnergySource.CAPPED: pytest.approx(10_000 / 50)}


def test_only_time_holding_work_books_draw() -> None:
    """Connected time holding no work (idle, paused: a pause gives the work back) is not
    Cleave's draw: a report of it books nothing; once it held work, the band is its held time."""
    books = EnergyBooks()
    books.joined(1, "cpu", 0.0)
    # An hour connected, holding nothing, claiming the ceiling for all of it: nothing booked.
    claim = books.claim(1, Energy(350.0 * 3600, 3600.0, EnergySource.RAPL), 0.0, held=0.0)
    assert claim.booked == {} and not claim.flagged and books.devices[1].joules == 0.0
    # Then 10 s holding work, its report claiming 5 kW for all 10 s: over 10 s (+5 s once) at 350 W.
    claim = books.claim(1, Energy(50_000.0, 10.0, EnergySource.RAPL), 0.0, held=10.0)
    assert claim.flagged and claim.booked == {EnergySource.CAPPED: pytest.approx(15 * 350)}
    claim = books.claim(1, Energy(1000.0, 10.0, EnergySource.RAPL), 0.0, held=20.0)
    assert not claim.flagged and books.devices[1].held == 20.0


def test_an_honest_machine_holding_work_part_of_the_time_books_its_draw_while_holding_unflagged() -> None:
    """A client reports its whole machine over wall-clock spans; the coordinator books the part
    of each report drawn while the device held work. An honest 150 W CPU holding work 9 s of
    every 30 s (a network-bound volunteer) is never flagged and books 150 W x its held seconds;
    a report of a span it held nothing books nothing, unflagged; one claiming 40 kW is still capped."""
    books = EnergyBooks()
    books.joined(1, "cpu", 0.0)
    flagged = [
        books.claim(1, Energy(150.0 * 30, 30.0, EnergySource.RAPL), 9.0 * i, held=9.0 * i).flagged for i in range(1, 11)
    ]
    assert flagged == [""] * 10 and books.devices[1].joules == pytest.approx(150.0 * 90)
    claim = books.claim(1, Energy(150.0 * 30, 30.0, EnergySource.RAPL), 90.0, held=90.0)  # 30 s idle
    assert claim.booked == {} and not claim.flagged
    claim = books.claim(1, Energy(40_000.0 * 30, 30.0, EnergySource.RAPL), 99.0, held=99.0)
    assert claim.flagged and books.devices[1].joules == pytest.approx((99 + 5) * CEILING_W["cpu"])
    assert books.flagged == 1


def test_the_increment_is_the_booked_draw_less_the_idle_draw_while_holding_work_within_zero_and_booked() -> None:
    """What a device's work added to a machine on anyway: its booked energy less its idle draw
    (by what the report measured) over the seconds it held work since its previous report; never
    below 0 (a hostile report of next to nothing), never above what was booked; the coordinator's
    own counts whole. Per claim, per step, in the summary and the step's row."""
    books = EnergyBooks()
    books.joined(1, "cpu", 0.0)
    books.joined(2, "cuda:0", 0.0)
    books.joined(3, "cpu", 0.0)
    # RAPL at 100 W over 30 s, holding work 9 of them: 900 J booked, less 2 W x 9 s.
    assert IDLE_W[EnergySource.RAPL] == 2.0 and IDLE_W[EnergySource.NVML] == 10.0
    claim = books.claim(1, Energy(3000.0, 30.0, EnergySource.RAPL), 0.0, held=9.0)
    assert sum(claim.booked.values()) == pytest.approx(900.0) and claim.increment == pytest.approx(900.0 - 2 * 9)
    # RAPL and NVML, 30 s held: the package's and the board's idle, 12 W x 30 s.
    claim = books.claim(2, Energy(1500.0, 30.0, EnergySource.RAPL, gpu_joules=3000.0), 0.0, held=30.0)
    assert not claim.flagged and claim.increment == pytest.approx(4500.0 - 12 * 30)
    # The estimate counts only Cleave's own seconds: all of it is the increment.
    claim = books.claim(3, Energy(600.0, 30.0, EnergySource.ESTIMATE), 0.0, held=30.0)
    assert claim.increment == 600.0
    # 1 J for 60 s held: below the idle draw, so nothing (never negative).
    claim = books.claim(1, Energy(1.0, 60.0, EnergySource.RAPL), 0.0, held=69.0)
    assert sum(claim.booked.values()) == 1.0 and claim.increment == 0.0
    # Capped at its ceiling (350 W x (79 s held + 5 s slack), less what it booked): its source is
    # not believed, so none of its idle comes off (a capped report is all increment).
    claim = books.claim(1, Energy(1e7, 10.0, EnergySource.BATTERY), 0.0, held=79.0)
    cap = 84 * CEILING_W["cpu"] - 901.0
    assert claim.flagged and claim.increment == pytest.approx(cap)
    # A report of time it held nothing: nothing booked, nothing on the increment.
    assert books.claim(1, Energy(500.0, 30.0, EnergySource.RAPL), 0.0, held=79.0).increment == 0.0
    books.own(500.0, EnergySource.ESTIMATE)
    step = books.close_step(gflop=0.0)
    devices = 882.0 + 4140.0 + 600.0 + cap
    assert step.devices_increment_j == pytest.approx(devices) and step.increment_j == pytest.approx(devices + 500)
    assert 0 < step.devices_increment_j <= step.devices_j
    assert step.as_row()["j_devices_increment"] == pytest.approx(devices, abs=1e-3)
    summary = books.summary(0.0)
    assert summary["devices_increment_j"] == pytest.approx(devices, abs=1e-3)
    assert summary["increment_j"] == pytest.approx(devices + 500, abs=1e-3)
    assert summary["increment_j"] <= summary["joules"]
    assert books.devices[1].increment == pytest.approx(882.0 + cap)


def test_a_reconnecting_identity_gets_its_slack_once_and_never_more_than_it_held() -> None:
    """An identity that takes one brief lease and reconnects, again and again, claiming a full
    draw each time, books only about the seconds it held work: its slack is no longer than what
    it held, and given once in the job."""
    books = EnergyBooks()
    booked = []
    for _ in range(10):
        books.joined(7, "cpu", 0.0)
        claim = books.claim(7, Energy(5000.0, 0.1, EnergySource.RAPL), 0.0, held=0.1)  # 50 kW
        booked.append(sum(claim.booked.values()))
        assert claim.flagged
        books.left(7)
    assert booked[0] == pytest.approx(0.2 * CEILING_W["cpu"]) and booked[1:] == [pytest.approx(35.0)] * 9
    assert books.devices == {} and sum(booked) == pytest.approx((10 * 0.1 + 0.1) * CEILING_W["cpu"])


def test_a_network_bound_gpu_gets_its_kinds_ceiling_by_its_gemm_seconds_and_a_cpu_saying_cuda_does_not() -> None:
    """A real GPU fed over a home link holds work all the time and delivers 1 TFLOP/s verified
    (a CPU's rate per held second), but its results state 20 TFLOP/s of GEMMs: its 450 W
    machine is believed. A CPU that says ``cuda:0`` and delivers the same, its results stating
    its real GEMM seconds (1 TFLOP/s), is held to a CPU's 350 W. Neither may look more
    efficient than a CPU: the floor follows the verified rate."""
    books = EnergyBooks()
    books.joined(1, "cuda:0", 0.0)
    books.joined(2, "cuda:0", 0.0)
    for i in range(1, 7):  # 6 reports of 30 s, 30,000 GFLOP verified in each
        gflop = 30_000.0 * i
        gpu = books.claim(
            1, Energy(4500.0, 30.0, EnergySource.RAPL, gpu_joules=9000.0), gflop, 30.0 * i, gflop / 20_000
        )
        assert not gpu.flagged and gpu.booked == {EnergySource.RAPL: 4500.0, EnergySource.NVML: 9000.0}
        cpu = books.claim(2, Energy(4500.0, 30.0, EnergySource.RAPL, gpu_joules=9000.0), gflop, 30.0 * i, gflop / 1000)
        assert cpu.flagged
    assert books.devices[1].joules == pytest.approx(6 * 13_500.0)
    assert books.devices[2].joules == pytest.approx((180 + 5) * CEILING_W["cpu"])
    assert books.devices[1].gpu_share == books.devices[2].gpu_share == 0.0  # the floor: a CPU's
    books.joined(3, "cuda:0", 0.0)  # its results state GEMMs at 30 PFLOP/s: that buys no efficiency
    claim = books.claim(3, Energy(1.0, 30.0, EnergySource.RAPL), 30_000.0, 30.0, 0.001)
    assert claim.flagged and claim.booked == {EnergySource.CAPPED: pytest.approx(30_000 / BEST_GFLOP_PER_J["cpu"])}


def test_a_claimed_gpu_kind_gets_its_band_only_for_work_beyond_a_cpus_rate() -> None:
    """The kind in a hello is the device's word: a device that delivers verified work at a CPU's
    rate (and whose results state a CPU's GEMM seconds) gets a CPU's band whatever it claims;
    one delivering beyond any CPU gets its kind's band for the share beyond."""
    books = EnergyBooks()
    books.joined(1, "cuda:0", 0.0)  # says it is a GPU, computes as a CPU does: 700 GFLOP/s
    claim = books.claim(1, Energy(1.0, 10.0, EnergySource.ESTIMATE, gpu_joules=4.0), 7000.0, held=10.0)
    assert claim.flagged and claim.booked == {EnergySource.CAPPED: pytest.approx(7000 / BEST_GFLOP_PER_J["cpu"])}
    assert books.devices[1].gpu_share == 0.0
    # A GPU's draw, its results stating a CPU's GEMM seconds (700 GFLOP/s): a CPU's ceiling.
    claim = books.claim(1, Energy(1e6, 10.0, EnergySource.ESTIMATE), 7000.0, held=20.0, compute=10.0)
    assert claim.flagged and books.devices[1].joules == pytest.approx(25 * CEILING_W["cpu"])  # a CPU's ceiling
    # A real GPU: 74 TFLOP/s verified over 10 s, beyond any CPU's 7.4 (plus 5 s of slack once).
    books.joined(2, "cuda:0", 0.0)
    done = 740_000.0
    share = (done - 15 * CPU_PEAK_GFLOPS) / done
    claim = books.claim(2, Energy(500.0, 10.0, EnergySource.RAPL, gpu_joules=2500.0), done, held=10.0)
    assert not claim.flagged and books.devices[2].gpu_share == pytest.approx(share)  # 246 GFLOP/J: believed
    # 1 J for 740 TFLOP more: the connection's floor, its CPU-rate share at a CPU's best.
    assert books.claim(2, Energy(1.0, 1.0, EnergySource.RAPL), 2 * done, held=20.0).flagged
    share = (2 * done - 25 * CPU_PEAK_GFLOPS) / (2 * done)
    least = 2 * done * ((1 - share) / BEST_GFLOP_PER_J["cpu"] + share / BEST_GFLOP_PER_J["cuda"])
    assert books.devices[2].joules == pytest.approx(least)


# --------------------------------------------------------------------------- the Core


def test_the_core_books_devices_reports_and_ranks_them_by_gflop_per_joule() -> None:
    from test_core import Fleet, core, submit

    from cleave.coordinator.engine import report
    from cleave.wire.messages import Error

    core = core.__wrapped__()  # the fixture's Core
    fleet = Fleet(core)
    frugal, hungry, cheat = fleet.join("frugal"), fleet.join("hungry"), fleet.join("cheat")
    # Reports next to nothing before it does any work, then never again: the work no report
    # covered cannot make it look efficient.
    assert core.handle(cheat, Energy(1e-6, 1.0, EnergySource.RAPL), fleet.now) == []
    a, b = torch.randn(64, 48), torch.randn(48, 40)
    box = submit(core, fleet, a, b)
    fleet.drain()
    torch.testing.assert_close(box["result"], a @ b, rtol=1e-5, atol=1e-5)
    assert all(core.devices[d].gflop_verified > 0 for d in (frugal, hungry, cheat)), "tiles reached every device"
    fleet.now += 30.0
    seen = fleet.now - 100.0  # since it joined (the fleet's clock starts at 100 s): its report's span
    assert core.handle(frugal, Energy(300.0, seen, EnergySource.RAPL), fleet.now) == []
    core.handle(hungry, Energy(1e7, seen, EnergySource.ESTIMATE), fleet.now)  # 333 kW: capped
    (err,) = [o.message for o in core.handle(frugal, Energy(1.0, 1.0, EnergySource.NVML), fleet.now)]
    assert isinstance(err, Error) and "energy.source" in err.message
    rows = {r.name: r for r in core.store.devices(core.job_id)}
    # Its whole machine's draw over the span, of which the part while it held work is booked.
    thrifty = 300.0 * core.devices[frugal].seat.held(fleet.now) / seen
    assert 0 < thrifty < 300.0 and rows["frugal"].joules == pytest.approx(thrifty)
    assert rows["frugal"].energy_flagged == 0
    held = core.devices[hungry].seat.held(fleet.now)  # its draw is booked for the time it held work
    assert 0 < held < seen and rows["hungry"].joules == pytest.approx((held + min(5, held)) * CEILING_W["cpu"])
    assert rows["hungry"].energy_flagged == 1
    status = report.status(core, fleet.now)
    assert status["energy"]["flagged"] == 1
    assert status["energy"]["devices_sources"]["rapl"] == pytest.approx(thrifty, abs=1e-3)
    # On the increment: frugal's booked RAPL figure less 2 W over the seconds it held work.
    frugal_held = core.devices[frugal].seat.held(fleet.now)
    assert core.energy.devices[frugal].increment == pytest.approx(thrifty - 2.0 * frugal_held)
    assert 0 < status["energy"]["devices_increment_j"] < status["energy"]["devices_j"]
    best = [r["name"] for r in status["leaderboard_efficiency"]]
    assert best == ["frugal", "hungry"]
    assert status["leaderboard_efficiency"][0]["joules"] == pytest.approx(thrifty, abs=1e-3)
    # cheat's one report covered time it held nothing: nothing booked, and its GFLOP never metered.
    assert rows["cheat"].joules == 0.0 and rows["cheat"].gflop_metered == 0.0
    listed = {d["name"]: d for d in status["devices"]}
    assert listed["frugal"]["energy_source"] == "rapl" and listed["hungry"]["energy_source"] == "capped"


def test_a_cpu_that_says_cuda_gets_a_cpus_band_and_an_idle_identity_books_no_draw() -> None:
    """Real hellos through the Core: ``spoof`` says ``cuda:0`` (and a 100 TFLOP/s benchmark) but
    returns its tiles at a CPU's pace, then reports a GPU's efficiency; ``honest`` says cpu and
    reports the best a CPU can do. ``idle`` joins when the work is done and claims a full draw
    for ten minutes connected."""
    from test_core import Fleet, core, submit

    from cleave.coordinator.engine import report

    core = core.__wrapped__()
    fleet = Fleet(core)
    honest, spoof = fleet.join("honest"), fleet.join("spoof", device="cuda:0", gflops=100_000.0)
    submit(core, fleet, torch.randn(64, 48), torch.randn(48, 40))
    fleet.drain()
    done = {d: core.devices[d].gflop_verified for d in (honest, spoof)}
    assert all(done.values()), "tiles reached both devices"
    idle = fleet.join("idle")
    fleet.now += 600.0
    core.handle(honest, Energy(done[honest] / BEST_GFLOP_PER_J["cpu"], 600.0, EnergySource.RAPL), fleet.now)
    core.handle(spoof, Energy(0.0, 600.0, EnergySource.RAPL, gpu_joules=done[spoof] / 1400), fleet.now)
    core.handle(idle, Energy(CEILING_W["cpu"] * 600.0, 600.0, EnergySource.RAPL), fleet.now)
    rows = {r.name: r for r in core.store.devices(core.job_id)}
    # The spoof's claimed kind bought nothing: booked at a CPU's best efficiency, and flagged.
    assert rows["spoof"].energy_flagged == 1
    assert rows["spoof"].gflop_metered / rows["spoof"].joules == pytest.approx(BEST_GFLOP_PER_J["cpu"])
    best = report.status(core, fleet.now)["leaderboard_efficiency"]
    assert [r["name"] for r in best] == ["honest", "spoof"]  # no better than a CPU: it tops nobody
    assert max(r["gflop_per_j"] for r in best) <= BEST_GFLOP_PER_J["cpu"] + 1e-3
    # Ten minutes connected holding nothing: no draw booked, and no lie flagged either.
    assert rows["idle"].joules == 0.0 and rows["idle"].energy_flagged == 0
    assert core.devices[idle].seat.held(fleet.now) == 0.0


# --------------------------------------------------------------------------- real processes


class FakeRapl:
    """A powercap folder whose package counter a thread advances at ``watts``."""

    def __init__(self, root: Path, watts: float) -> None:
        self.counter = _zone(root, "intel-rapl:0", "package-0", 0)
        self.watts, self.start = watts, time.monotonic()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            uj = int((time.monotonic() - self.start) * self.watts * 1e6) % 262_143_328_850
            tmp = self.counter.with_suffix(".tmp")
            tmp.write_text(f"{uj}\n")
            tmp.replace(self.counter)


@pytest.mark.drill
def test_clients_report_their_machines_energy_and_an_implausible_one_is_capped(tmp_path: Path) -> None:
    """A real coordinator and two real clients, each reading a fake RAPL counter: one at 25 W,
    one at 5 kW (a CPU machine cannot draw that). Both compute tiles; the honest one's energy is
    booked as RAPL, the other's is capped at its kind's ceiling and flagged; every step's metrics
    row carries the energy split into devices and coordinator, per verified GFLOP and in CO2;
    status and /metrics say the same."""
    from procs import Coordinator, join

    from tests.client.test_relays import _look

    honest, liar = FakeRapl(tmp_path / "honest", 25.0), FakeRapl(tmp_path / "liar", 5000.0)
    try:
        coord = Coordinator(
            tmp_path, "--min-devices", "2", "--checkpoint-every", "0", "--grid-gco2-kwh", "300", steps=4
        )
        clients = [
            join(coord.url, name, "--powercap", str(tmp_path / name), "--energy-every", "0.5")
            for name in ("honest", "liar")
        ]
        coord.wait_for_step(3)  # mid-run: status --json and /metrics carry the books
        status, scraped = _look(coord)
        assert coord.wait() == 0, coord.output
        assert [c.wait() for c in clients] == [0, 0], [c.output for c in clients]
    finally:
        honest.stop.set()
        liar.stop.set()
    rows = {name: (j, flagged, g) for name, j, flagged, g in coord.query(
        "SELECT name, joules, energy_flagged, gflop_verified FROM devices")}  # fmt: skip
    assert rows["honest"][0] > 0 and rows["honest"][1] == 0 and rows["honest"][2] > 0, rows
    # Its counter ran at 25 W: what was booked is 25 W over the seconds it held work within the
    # time its reports covered (a good part of the run: 60% on two loaded cores), never more than
    # over the whole run.
    run_s = sum(r["seconds"] for r in coord.rows())
    assert 0.1 * 25.0 * run_s <= rows["honest"][0] <= 25.0 * (run_s + 15.0), (rows, run_s)
    assert rows["liar"][1] >= 1 and rows["liar"][2] > 0, rows
    steps = coord.rows()
    assert all(r["j_coordinator"] > 0 for r in steps), steps  # this machine: the estimate
    assert sum(r["j_devices"] for r in steps) > 0 and any(r["energy_flagged"] for r in steps)
    assert any("rapl" in r["energy_sources"] for r in steps) and any("capped" in r["energy_sources"] for r in steps)
    assert all(r["gco2"] > 0 for r in steps)
    energy = status["energy"]
    assert energy["grid_gco2_kwh"] == 300.0 and energy["flagged"] >= 1 and energy["coordinator_sources"]
    joules = [line for line in scraped.splitlines() if line.startswith("cleave_energy_joules_total")]
    assert any('source="rapl"' in line for line in joules) and any('source="capped"' in line for line in joules)
    assert 0 < energy["devices_increment_j"] < energy["devices_j"]
    assert any(line.startswith('cleave_energy_increment_joules_total{part="devices"}') for line in scraped.splitlines())


def test_a_gpu_nvml_cannot_read_is_estimated_from_its_gemm_seconds_and_emulated_devices_read_no_counter(
    tmp_path: Path,
) -> None:
    from cleave.meters import GPU_WATTS

    clock = Clock()
    gemm = [0.0]
    _zone(tmp_path / "powercap", "intel-rapl:0", "package-0", 0)
    meter = EnergyMeter(
        powercap=tmp_path / "none", power_supply=tmp_path / "none", cpu_seconds=lambda: clock.cpu, clock=clock,
        gpu="mps", gpu_seconds=lambda: gemm[0],
    )  # fmt: skip
    clock.cpu += 1.0
    gemm[0] += 3.0
    span = meter.span()
    assert span.source is EnergySource.ESTIMATE
    assert (
        span.joules == pytest.approx(WATTS_PER_CORE + 3.0 * GPU_WATTS["mps"])
        and "20 W while in GEMMs" in meter.describe()
    )
    emulated = EnergyMeter(
        powercap=tmp_path / "powercap", estimate_only=True, cpu_seconds=lambda: clock.cpu, clock=clock
    )
    assert not emulated.rapl and "emulated" in emulated.describe()
    blind = EnergyMeter(powercap=tmp_path / "none", power_supply=tmp_path / "none", gpu="cuda", nvml=None)
    assert "not counted" in blind.describe()  # no NVML, no GEMM seconds: said, not guessed
