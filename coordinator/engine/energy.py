"""The job's energy books: what devices say they used, what of it is believed, and what the
coordinator used itself; per step, per verified GFLOP, and in grams of CO2 (issue 23).

A device's report (``energy``) is its word: its whole machine's energy over ``seconds`` of wall
clock since its previous report. Only the time it held work (leases outstanding, by this clock)
is Cleave's draw, so each report is first scaled by the seconds it held work since its previous
report over the seconds it covers (idle time books nothing, and an honest reporter is not
flagged for it). The scaled figure is believed within a band kept over its whole connection,
so that no way of cutting it into reports widens it: what is booked for a device may not exceed
the seconds it held work (plus ``SLACK_S`` once per identity in the job, never more than it
held) times its ceiling in watts, nor fall below the GFLOP it had verified by its last report
over its best GFLOP per joule (a device may not look more efficient than that on the
leaderboard); a scaled figure below that floor whose whole report covers it is booked at the
floor, unflagged. Connected time holding nothing books nothing (and time paused holds nothing:
a pause gives the work back).

The band's kind (``hello.device``) is the device's word too, believed as far as evidence bears
it out, each edge by the evidence that cannot be bent the way that edge guards against:

- the floor (the leaderboard's lever) by the verified rate: of the GFLOP the coordinator
  verified, those a CPU could have delivered in the time it held work (``CPU_PEAK_GFLOPS`` per
  second) are held to the CPU's efficiency; only the share beyond gets its kind's. A device
  cannot inflate verified GFLOP, nor shorten this clock's seconds: a CPU that says ``cuda:0``
  can look no more efficient than a CPU.
- the ceiling by the compute rate its results report (verified GFLOP over the GEMM seconds its
  results state): of its GFLOP, those a CPU could have computed in those seconds are held to the
  CPU's ceiling, the rest gets its kind's. A GPU fed over a home link holds work mostly waiting
  on the link, so its verified rate per held second is a CPU's; its GEMM seconds are a GPU's.
  Those seconds are its word: a client that also shortens them books up to its kind's ceiling
  for the time it held work (1,050 W for cuda), and only looks less efficient for it.

A claim outside the band is booked at the band's edge, under the source ``capped``, and
flagged: never as measured. The leaderboard divides the GFLOP its reports covered
(``gflop_metered``), not all it did, by what was booked. The sources of the constants are in
docs/operations.md "Energy and carbon".

Each booking is also counted on the increment (issue 37): what Cleave's work added to a machine
that is on anyway, the booked figure less the machine's idle draw (``IDLE_W``, by what the report
measured) over the seconds it held work since its previous report, never below 0 nor above the
booked figure (a hostile report can only move it within those). The coordinator is a dedicated
machine: its own energy counts whole both ways.

Pure: ``now`` in, no I/O. The Core holds one; the job feeds it the coordinator's own meter.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from cleave.wire.codes import EnergySource
from cleave.wire.messages import MAX_GRID, Energy

log = logging.getLogger(__name__)

# The most a machine of each kind draws at the wall, whole: a device's report may not exceed
# this times its time. cpu: AMD Ryzen Threadripper 7980X's 350 W TDP (the largest desktop
# part; Intel's i9-14900K is 253 W); mps: Apple Mac Studio (M2 Ultra), 370 W maximum continuous
# power (Apple's specifications); cuda: NVIDIA H100 SXM5's 700 W board power plus the cpu
# ceiling for its host.
CEILING_W: dict[str, float] = {"cpu": 350.0, "mps": 370.0, "cuda": 1050.0}
# The most verified GFLOP a machine of each kind does per joule (fp32, the wire's exact dtype).
# cpu: 96 cores of AMD EPYC 9654 at 2.4 GHz x 32 fp32 FLOP/cycle (AVX-512, 2 FMA) = 7.4 TFLOP/s
# over 360 W, about 20; we allow 50. mps: Apple M2 Ultra's GPU, 27.2 TFLOP/s fp32 (Apple) at
# ~100 W, about 270; we allow 400. cuda: H100 SXM5's 67 TFLOP/s fp32 (989 in bf16) at 700 W,
# 96 (1,400); we allow 1,500 (half-precision wires).
BEST_GFLOP_PER_J: dict[str, float] = {"cpu": 50.0, "mps": 400.0, "cuda": 1500.0}
# The most verified GFLOP/s a CPU delivers: the same AMD EPYC 9654, 96 cores x 2.4 GHz x 32 fp32
# FLOP/cycle = 7,373 GFLOP/s. Verified GFLOP over the seconds a device held work is a rate it
# cannot inflate (its results are checked, the seconds are this clock's): what it delivered up
# to this rate is held to the CPU's efficiency, whatever kind it claims; what it computed up to
# this rate in the GEMM seconds its results state is held to the CPU's ceiling.
CPU_PEAK_GFLOPS = 7400.0
# Seconds its reports may cover beyond what this clock saw: once per identity in the job (a
# reconnect gets none), and never more than it held work (a brief lease buys a brief slack).
SLACK_S = 5.0
# The idle draw of what each source measures, subtracted from a device's booked energy over the
# seconds it held work to give its increment over a machine on anyway. The low end of each range,
# so the increment errs against Cleave. Our assumptions (approx.): rapl, the CPU packages idle
# (a laptop's idles at a watt or two, a desktop's at 5-15 W in reviews' package-power
# measurements): 2 W; nvml, a GPU board idle (desktop GeForce boards idle at 10-20 W, as the
# simulator assumes: coordinator/whatif/energy.py): 10 W; battery, the whole machine on its
# battery, idle and awake on Wi-Fi (the simulator's 15 W-class laptop): 5 W; estimate: 0, since it
# counts only Cleave's own CPU and GEMM seconds, none of the machine's idle draw.
IDLE_W: dict[EnergySource, float] = {
    EnergySource.RAPL: 2.0,
    EnergySource.NVML: 10.0,
    EnergySource.BATTERY: 5.0,
    EnergySource.ESTIMATE: 0.0,
}
DEVICE_SOURCES = (EnergySource.RAPL, EnergySource.BATTERY, EnergySource.ESTIMATE)
# World-average carbon intensity of electricity generation, gCO2e/kWh: 436 in 2022 (Ember, *Global
# Electricity Review 2023*). A location-based figure: what the average kWh on the world's grids
# emitted; an operator (cleave coordinator start) or a volunteer (cleave join) states their own
# grid with --grid-gco2-kwh. The simulator uses the same (coordinator/whatif/energy.py).
GRID_GCO2_KWH = 436.0
J_PER_KWH = 3.6e6


def kind_of(device: str) -> str:
    """The ceiling's kind for a hello's ``device`` (``cuda:0`` is cuda; unknown: cpu)."""
    head = device.split(":")[0].lower()
    return head if head in CEILING_W else "cpu"


def grams(joules: float, gco2_kwh: float) -> float:
    """Grams of CO2 for ``joules`` on a grid emitting ``gco2_kwh`` per kWh."""
    return joules / J_PER_KWH * gco2_kwh


@dataclass(frozen=True)
class Claim:
    """What one report decided."""

    booked: dict[EnergySource, float]  # joules per source as booked
    flagged: str  # why it was capped ("" if believed)
    grams: float
    gflop: float  # verified GFLOP the report covers (since the device's previous one)
    increment: float = 0.0  # of the booked joules, those over its idle draw (0 <= it <= booked)

    def credit(self) -> dict[str, Any]:
        """The device's credit for it in the store (``Store.credit_device``'s fields)."""
        return {
            "joules": sum(self.booked.values()),
            "energy_flagged": int(bool(self.flagged)),
            "gflop_metered": self.gflop,
        }


@dataclass
class DeviceEnergy:
    """One device's energy in this job (while it is connected)."""

    kind: str  # as its hello claims (its band follows it only as far as its rate does)
    gflop_at: float  # its verified GFLOP at its last report (or welcome)
    gflop_start: float  # ... at its welcome
    slack: float = SLACK_S  # seconds of slack this connection may have (0 after the identity's first)
    held: float = 0.0  # seconds it held work, by its last report (this clock)
    gpu_share: float = 0.0  # of its verified GFLOP, the share delivered beyond a CPU's rate (its floor)
    ceiling_share: float = 0.0  # ... the share computed beyond a CPU's rate, by its results' seconds
    joules: float = 0.0  # booked
    increment: float = 0.0  # ... of which over its machine's idle draw
    grams: float = 0.0
    flagged: int = 0
    source: str = ""  # of its last report (``rapl+nvml`` for a GPU device)


@dataclass
class Ledger:
    """Joules by source, grams, and joules on the increment over machines on anyway."""

    joules: dict[EnergySource, float] = field(default_factory=dict)
    grams: float = 0.0
    increment: float = 0.0

    def add(self, booked: dict[EnergySource, float], grams: float, increment: float | None = None) -> None:
        """Book these joules (by source), grams, and ``increment`` of them (None: all)."""
        for source, j in booked.items():
            self.joules[source] = self.joules.get(source, 0.0) + j
        self.grams += grams
        self.increment += sum(booked.values()) if increment is None else increment

    @property
    def total(self) -> float:
        """Joules, every source."""
        return sum(self.joules.values())

    def mix(self) -> dict[str, float]:
        """Joules by source name (JSON)."""
        return {s.value: round(j, 3) for s, j in sorted(self.joules.items(), key=lambda kv: kv[0].value)}


@dataclass(frozen=True)
class StepEnergy:
    """One step's energy: what devices reported during it and what the coordinator used."""

    devices_j: float
    coordinator_j: float
    grams: float
    gflop: float  # verified during the step
    sources: dict[str, float]  # devices' and coordinator's joules by source
    flagged: int  # device reports capped during it
    devices_increment_j: float = 0.0  # of devices_j, over their machines' idle draw

    @property
    def increment_j(self) -> float:
        """Over machines on anyway: the devices' increment, the coordinator's whole."""
        return self.devices_increment_j + self.coordinator_j

    @property
    def joules(self) -> float:
        """Devices' and coordinator's."""
        return self.devices_j + self.coordinator_j

    @property
    def j_per_gflop(self) -> float | None:
        """Joules per verified GFLOP (None: nothing verified)."""
        return self.joules / self.gflop if self.gflop > 0 else None

    def as_row(self) -> dict[str, object]:
        """The step's metrics row fields (``--metrics``, the books)."""
        per = self.j_per_gflop
        return {
            "j_devices": round(self.devices_j, 3),
            "j_devices_increment": round(self.devices_increment_j, 3),
            "j_coordinator": round(self.coordinator_j, 3),
            "j_per_gflop": None if per is None else round(per, 4),
            "gco2": round(self.grams, 4),
            "energy_sources": self.sources,
            "energy_flagged": self.flagged,
        }


class EnergyBooks:
    """The job's energy, by device and by step, and the coordinator's own."""

    def __init__(self, grid_gco2_kwh: float = GRID_GCO2_KWH) -> None:
        if not (math.isfinite(grid_gco2_kwh) and 0 <= grid_gco2_kwh <= MAX_GRID):
            raise ValueError(f"--grid-gco2-kwh must be between 0 and {MAX_GRID:g}, got {grid_gco2_kwh}")
        self.grid = grid_gco2_kwh
        self.devices: dict[int, DeviceEnergy] = {}
        self.job_devices = Ledger()  # every device's booked joules, over the job
        self.job_coordinator = Ledger()
        self.flagged = 0  # over the job
        self._step_devices = Ledger()
        self._step_coordinator = Ledger()
        self._step_flagged = 0
        self._gflop_at = 0.0  # the job's verified GFLOP when the step began
        self._slacked: set[int] = set()  # identities (device ids) given their slack in this job

    def joined(self, device: int, kind: str, gflop: float) -> None:
        """A device is welcomed, with ``gflop`` verified before (other connections)."""
        slack = 0.0 if device in self._slacked else SLACK_S
        self.devices[device] = DeviceEnergy(kind_of(kind), gflop, gflop, slack=slack)

    def left(self, device: int) -> DeviceEnergy | None:
        """A device is gone: its span ends unreported."""
        return self.devices.pop(device, None)

    def report(self, device: int, name: str, msg: Energy, gflop: float, held: float, compute: float) -> Claim:
        """``claim``, and a capped claim said in the operator's log (at its 1st, 10th, 100th and
        1000th, not at every report)."""
        claim = self.claim(device, msg, gflop, held, compute)
        flagged = self.devices[device].flagged
        if claim.flagged and flagged in (1, 10, 100, 1000):
            log.warning("device %d (%s): energy claim capped (%d so far): %s", device, name, flagged, claim.flagged)
        return claim

    def claim(self, device: int, msg: Energy, gflop: float, held: float, compute: float = 0.0) -> Claim:
        """A device's report, when its verified GFLOP are ``gflop`` in all, it has held work for
        ``held`` seconds over this connection (the scheduler's count, this clock) and its results
        state ``compute`` seconds of GEMMs: booked within its band. Raises ValueError for a source
        a device may not claim."""
        if msg.source not in DEVICE_SOURCES:
            raise ValueError(f"energy.source must be one of {', '.join(s.value for s in DEVICE_SOURCES)}")
        dev = self.devices.get(device)
        if dev is None:
            raise ValueError(f"device {device} is not metered here")
        held_since = max(0.0, held - dev.held)  # since its previous report
        dev.held = max(dev.held, held)
        if dev.held > 0:
            self._slacked.add(device)
        span = dev.held + min(dev.slack, dev.held)  # held nothing: none of its draw is Cleave's
        done = max(0.0, gflop - dev.gflop_start)  # verified over this connection
        gpu = dev.kind != "cpu" and done > 0
        cpu_could = min(done, span * CPU_PEAK_GFLOPS)  # ... of which a CPU could have delivered
        dev.gpu_share = (done - cpu_could) / done if gpu else 0.0
        cpu_computes = min(done, compute * CPU_PEAK_GFLOPS)  # ... or computed in its GEMM seconds
        dev.ceiling_share = max(dev.gpu_share, (done - cpu_computes) / done) if gpu else 0.0
        top = dev.ceiling_share
        watts = (1.0 - top) * CEILING_W["cpu"] + top * CEILING_W[dev.kind]
        most = span * watts - dev.joules  # over its connection: no report widens it
        covered = max(0.0, gflop - dev.gflop_at)
        own = dev.gpu_share
        least = done * ((1.0 - own) / BEST_GFLOP_PER_J["cpu"] + own / BEST_GFLOP_PER_J[dev.kind]) - dev.joules
        claimed = msg.joules + msg.gpu_joules
        # Its whole machine over the report's seconds: the part drawn while it held work is
        # Cleave's (at least the floor, when the whole report covers it).
        part = min(1.0, held_since / msg.seconds) if msg.seconds > 0 else float(held_since > 0)
        if claimed > 0 and least > 0:
            part = min(1.0, max(part, least / claimed))
        scaled = claimed * part
        flagged = ""
        if dev.held == 0.0:  # a report of time it held nothing (a leave, a pause): nothing to book, no lie
            booked = {}
        elif scaled > most:
            flagged = f"{scaled:.0f} J is over {watts:.0f} W for the {dev.held:.0f} s it held work"
            booked = {EnergySource.CAPPED: max(0.0, most)}
        elif claimed < least:
            flagged = f"{claimed:.0f} J for {covered:.0f} GFLOP is beyond the efficiency its measured rate allows"
            booked = {EnergySource.CAPPED: least}
        else:
            booked = {
                s: j * part for s, j in ((msg.source, msg.joules), (EnergySource.NVML, msg.gpu_joules)) if j * part > 0
            }
        whole = sum(booked.values())
        # Its machine's idle draw over the seconds it held work (no more than the report covers),
        # as its source says; none for a capped report (its source is not believed). Never below
        # what its verified GFLOP cost at the best efficiency its rate allows (``least``).
        idle_w = IDLE_W[msg.source] + (IDLE_W[EnergySource.NVML] if msg.gpu_joules > 0 else 0.0)
        idle_w = 0.0 if flagged else idle_w
        idle_s = min(held_since, msg.seconds)
        increment = min(whole, max(0.0, least, whole - idle_w * idle_s))
        grid = msg.grid_gco2_kwh or self.grid
        g = grams(whole, grid)
        dev.gflop_at = gflop
        dev.joules += whole
        dev.increment += increment
        dev.grams += g
        dev.source = "+".join(s.value for s in booked) or msg.source.value
        if flagged:
            dev.flagged += 1
            self.flagged += 1
            self._step_flagged += 1
        self.job_devices.add(booked, g, increment)
        self._step_devices.add(booked, g, increment)
        return Claim(booked, flagged, g, covered, increment)

    def own(self, joules: float, source: EnergySource, gpu_joules: float = 0.0) -> None:
        """The coordinator's own meter, over the span since its last read."""
        booked = {s: j for s, j in ((source, joules), (EnergySource.NVML, gpu_joules)) if j > 0}
        g = grams(joules + gpu_joules, self.grid)
        self.job_coordinator.add(booked, g)
        self._step_coordinator.add(booked, g)

    def close_step(self, gflop: float) -> StepEnergy:
        """The step is over (the job's verified GFLOP are ``gflop`` in all): its energy."""
        sources = Ledger()
        sources.add(self._step_devices.joules, 0.0)
        sources.add(self._step_coordinator.joules, 0.0)
        out = StepEnergy(
            self._step_devices.total,
            self._step_coordinator.total,
            self._step_devices.grams + self._step_coordinator.grams,
            max(0.0, gflop - self._gflop_at),
            sources.mix(),
            self._step_flagged,
            self._step_devices.increment,
        )
        self._step_devices, self._step_coordinator, self._step_flagged = Ledger(), Ledger(), 0
        self._gflop_at = gflop
        return out

    def summary(self, gflop: float) -> dict[str, object]:
        """The job's energy so far (``status.energy``)."""
        total = self.job_devices.total + self.job_coordinator.total
        return {
            "joules": round(total, 3),
            "devices_j": round(self.job_devices.total, 3),
            "coordinator_j": round(self.job_coordinator.total, 3),
            # Over machines on anyway: devices' booked draw less their idle, the coordinator's whole.
            "increment_j": round(self.job_devices.increment + self.job_coordinator.total, 3),
            "devices_increment_j": round(self.job_devices.increment, 3),
            "kwh": round(total / J_PER_KWH, 6),
            "gco2": round(self.job_devices.grams + self.job_coordinator.grams, 3),
            "grid_gco2_kwh": self.grid,
            "gflop_verified": round(gflop, 3),
            "j_per_gflop": round(total / gflop, 4) if gflop > 0 else None,
            "gflop_per_j": round(gflop / total, 4) if total > 0 else None,
            "devices_sources": self.job_devices.mix(),
            "coordinator_sources": self.job_coordinator.mix(),
            "flagged": self.flagged,
        }
