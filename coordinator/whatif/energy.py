"""What a training step costs in energy and carbon: Cleave's fleet and coordinator, the DTFM-style
pipeline, and the cloud. Pure arithmetic: no I/O, no clock.

Every power here is at the wall (what a meter at the socket would read) and comes with its source
in a comment and in docs/simulation.md ("Energy"). A device draws its busy power while it computes,
its idle power while it waits on the network (awake, connected, not computing) and ``STANDBY_W``
while its client sleeps in standby; a datacentre machine draws its power times the facility's PUE.
Homes have no PUE: their wall figures already count the power supply's or charger's losses, and
home cooling is not counted (our assumption). Where a figure is our own assumption, the comment
says so; "approx." marks round published values.

Each step is counted two ways (issue 37): the whole draw (``energy_j``: as if the machines were on
for Cleave alone), and the increment over machines that are on anyway (``increment_j``): a
volunteer's device adds its busy power minus its idle power while it computes and nothing while it
waits or sleeps; dedicated machines (the coordinator, relays, the cloud's nodes) count whole both
ways. The truth for a fleet lies between the two.

Units: watts, seconds, joules; FLOP; bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from cleave.coordinator.engine.energy import GRID_GCO2_KWH, J_PER_KWH
from cleave.coordinator.planning.costmodel import CostModelError, DeviceClass
from cleave.coordinator.whatif.baselines import CloudResult, DtfmResult

# --------------------------------------------------------------------------- carbon and facilities

# The grid's carbon intensity (436 gCO2e/kWh, the world's in 2022, Ember) and joules per kWh:
# the running coordinator's books and the simulator use the same figures.
# Power usage effectiveness of a datacentre (facility power / IT power). Google's published fleet
# figure for its own datacentres, trailing twelve months, about 1.10 (Google, "Data centers:
# efficiency" page, 2021-2023; approx.): the cloud's best case, so the comparison errs in the
# cloud's favour, as its time does.
PUE_HYPERSCALE = 1.10
# The industry's average, 1.58 in 2023 (Uptime Institute, *Global Data Center Survey 2023*): for
# --pue when the GPUs or the coordinator sit in an ordinary colocation facility.
PUE_INDUSTRY_AVERAGE = 1.58
PUE_DEFAULT = PUE_HYPERSCALE

# Network transmission: 0.06 kWh/GB in 2015 for core and fixed-line access networks, halving about
# every 2 years since 2000 (Aslan, Mayers, Koomey and France, "Electricity Intensity of Internet
# Data Transmission: Untangling the Estimates", Journal of Industrial Ecology 22(4), 2018).
# Extrapolated to 2023 by that halving (4 halvings): our extrapolation, approx. Per-byte figures
# for networks are contested (their power hardly changes with traffic), so this stays apart from
# the step's energy (``network_j``), never added to ``energy_j``.
NETWORK_KWH_PER_GB_2015 = 0.06
NETWORK_HALVING_YEARS = 2.0
NETWORK_YEAR = 2023
NETWORK_J_PER_BYTE = NETWORK_KWH_PER_GB_2015 / 2 ** ((NETWORK_YEAR - 2015) / NETWORK_HALVING_YEARS) * J_PER_KWH / 1e9

# --------------------------------------------------------------------------- datacentre GPUs

# Board power (TDP) of the SXM parts: A100 80GB SXM 400 W (NVIDIA A100 Tensor Core GPU datasheet),
# H100 SXM5 700 W (NVIDIA H100 Tensor Core GPU datasheet).
A100_SXM_W = 400.0
H100_SXM_W = 700.0
# An 8-GPU node at its rated maximum: DGX A100 6.5 kW (NVIDIA DGX A100 datasheet), DGX H100
# 10.2 kW (NVIDIA DGX H100 datasheet). What is not the eight boards (CPUs, memory, NVSwitches,
# NICs, fans, power-supply losses) is the host's share per GPU. A maximum: a node training draws
# less (the DGX H100 documentation gives about 6.5-8.5 kW typical, approx.), so this errs against
# the cloud.
DGX_A100_MAX_W = 6500.0
DGX_H100_MAX_W = 10200.0
GPUS_PER_NODE = 8
# The board draws its rated power while training: as Touvron et al. 2023 (*Llama 2*, sec. 2.2.1,
# Table 2) count each A100-80GB at its 400 W (350 W) power cap. An upper end (approx.): measured
# averages of large training runs are somewhat lower; model-FLOPs utilisation (45%) measures useful
# FLOP, not power, and boards doing dense GEMMs run near their power limit.
GPU_TRAINING_POWER_SHARE = 1.0


@dataclass(frozen=True)
class NodePower:
    """A datacentre GPU and its share of the node's host, watts at the wall before PUE."""

    board_w: float
    host_w: float
    source: str


CLOUD_POWER: dict[str, NodePower] = {
    "a100-80gb": NodePower(
        A100_SXM_W,
        (DGX_A100_MAX_W - GPUS_PER_NODE * A100_SXM_W) / GPUS_PER_NODE,
        "NVIDIA A100 datasheet (400 W SXM); DGX A100 datasheet (6.5 kW max per 8 GPUs)",
    ),
    "h100-80gb": NodePower(
        H100_SXM_W,
        (DGX_H100_MAX_W - GPUS_PER_NODE * H100_SXM_W) / GPUS_PER_NODE,
        "NVIDIA H100 datasheet (700 W SXM5); DGX H100 datasheet (10.2 kW max per 8 GPUs)",
    ),
}

# --------------------------------------------------------------------------- coordinators

# The cost model's default coordinator ("server": a many-core server, 1 TFLOP/s of its own GEMMs)
# at load, at the wall: 500 W. Our assumption (approx.): published SPECpower_ssj2008 results for
# dual-socket servers draw a few hundred watts at full load. Drawn for the whole step whatever it
# does (errs against Cleave).
SERVER_W = 500.0
# A coordinator on one H100 SXM5 (``--coordinator h100``): the board at its rated power and the
# same server as its host.
COORDINATOR_POWER: dict[str, float] = {"server": SERVER_W, "h100": H100_SXM_W + SERVER_W}
# A relay (``--relays``): a small server or a cloud VM moving blocks. Our assumption.
RELAY_W = 150.0

# --------------------------------------------------------------------------- volunteer devices

# Desktop GPUs: the board's rated total graphics power (NVIDIA GeForce spec pages: RTX 3060 170 W,
# RTX 3080 320 W, RTX 4090 450 W) plus the rest of the desktop feeding it (CPU, memory, board,
# fans: 60 W busy, 45 W idle with the GPU's own idle 10-20 W; our assumption), through a power
# supply of 87% efficiency (80 PLUS Gold's required minimum at 20% and 100% load, 115 V).
RTX_3060_W = 170.0
RTX_3080_W = 320.0
RTX_4090_W = 450.0
DESKTOP_HOST_BUSY_W = 60.0
DESKTOP_IDLE_DC_W = 50.0  # the whole desktop, idle with its GPU, before the power supply
PSU_EFFICIENCY = 0.87


def _desktop(board_w: float) -> tuple[float, float]:
    return (board_w + DESKTOP_HOST_BUSY_W) / PSU_EFFICIENCY, DESKTOP_IDLE_DC_W / PSU_EFFICIENCY


@dataclass(frozen=True)
class DevicePower:
    """A volunteer device at the wall: busy (computing), idle (awake, connected, waiting)."""

    busy_w: float
    idle_w: float
    source: str

    @property
    def increment_w(self) -> float:
        """What computing adds to the machine idle and awake, on anyway (never below 0)."""
        return max(0.0, self.busy_w - self.idle_w)


_RTX = "board: NVIDIA GeForce spec page; host and idle: our assumption; 80 PLUS Gold power supply"
DEVICE_POWER: dict[str, DevicePower] = {
    # Phones compute while charging, screen off. Sustained SoC load of a few watts (published
    # reviews' SoC power measurements under GPU load, approx.) plus the charger's losses; idle:
    # awake on Wi-Fi. Our assumptions.
    "phone-flagship": DevicePower(6.0, 1.0, "our assumption (approx.: sustained SoC load, charger losses)"),
    "phone-mid": DevicePower(4.0, 0.8, "our assumption (approx.: sustained SoC load, charger losses)"),
    # x86 laptops on the charger, lid closed: a 15 W-class (U-series) and a 45 W-class (H-series)
    # CPU at sustained all-core load plus the platform and the charger's losses; idle awake with
    # Wi-Fi. Our assumptions from the vendors' TDP classes (approx.).
    "laptop-low": DevicePower(25.0, 5.0, "our assumption from Intel/AMD 15 W TDP class (approx.)"),
    "laptop-high": DevicePower(55.0, 8.0, "our assumption from Intel/AMD 45 W TDP class (approx.)"),
    "laptop-zen4": DevicePower(45.0, 7.0, "our assumption from AMD Ryzen 7040 HS 35-54 W (approx.)"),
    # Apple: Apple publishes the Mac mini's power at idle and at maximum (support page "Mac mini
    # power consumption and thermal output"): M1 6.8 W idle, 39 W max; M2 about 7 W and 50 W
    # (approx.). A GPU-only GEMM load is below the whole machine's maximum: our busy figures.
    "apple-m1": DevicePower(30.0, 6.8, "Apple Mac mini (M1) power page: 6.8 W idle, 39 W max; busy ours"),
    "apple-m2-m3": DevicePower(35.0, 7.0, "Apple Mac mini (M2) power page, approx.: 7 W idle, 50 W max; busy ours"),
    "apple-m2-m3-pro": DevicePower(60.0, 8.0, "our assumption: a Pro GPU's sustained load (approx.)"),
    "rtx-3060": DevicePower(*_desktop(RTX_3060_W), _RTX),
    "rtx-3080": DevicePower(*_desktop(RTX_3080_W), _RTX),
    "rtx-4090": DevicePower(*_desktop(RTX_4090_W), _RTX),
}
# A class that is not a preset (a fleet file's) takes the power of the preset class nearest to it
# by fp32 rate (on a log scale): our assumption, flagged ``estimated`` in reports.
_REFERENCE_FP32 = {
    "phone-flagship": 500.0,
    "phone-mid": 150.0,
    "laptop-low": 150.0,
    "laptop-high": 400.0,
    "laptop-zen4": 450.0,
    "apple-m1": 1600.0,
    "apple-m2-m3": 2300.0,
    "apple-m2-m3-pro": 3800.0,
    "rtx-3060": 8000.0,
    "rtx-3080": 18000.0,
    "rtx-4090": 50000.0,
}


def device_power(cls: DeviceClass) -> tuple[DevicePower, bool]:
    """A class's power, and whether it was estimated (not a preset class: the nearest preset by
    fp32 GFLOP/s; ties to the lower-powered one)."""
    if cls.name in DEVICE_POWER:
        return DEVICE_POWER[cls.name], False
    rate = cls.profile.gflops.get("fp32") or max(cls.profile.gflops.values(), default=0.0)
    if not rate > 0:
        raise CostModelError(f"class {cls.name!r}: no rate to estimate its power from")
    nearest = min(_REFERENCE_FP32, key=lambda n: (abs(math.log(rate / _REFERENCE_FP32[n])), DEVICE_POWER[n].busy_w))
    return DEVICE_POWER[nearest], True


# A device in standby: the coordinator told it it has no work for a while, so its client stops
# heartbeating beyond a slow keep-alive and frees its memory, and the machine may sleep. Its whole
# draw then: 0.5 W, the EU's ceiling for equipment in standby or off mode since 2013 (Commission
# Regulation (EC) No 1275/2008, tier 2). One figure for every class: our assumption (approx.: a
# phone asleep draws less, a desktop keeping its network link awake somewhat more). It assumes
# the owner's machine suspends while the client sleeps: today's client keeps its websocket, whose
# pings (every 20 s) keep the network awake, so this is the whole draw's floor, not a measurement.
STANDBY_W = 0.5
# The increment over a machine that is on anyway: waiting awake or in standby adds nothing to its
# idle draw (the heartbeats, the keep-alive: negligible; our assumption), so only its computing
# counts, at busy minus idle power (``DevicePower.increment_w``).


# --------------------------------------------------------------------------- the books of a step


@dataclass(frozen=True)
class Energy:
    """One step's energy. ``energy_j`` is devices plus datacentre (coordinator or cloud nodes, PUE
    included), the whole draw; ``increment_j`` the same over machines on anyway (devices' increment
    plus the datacentre's whole); ``network_j`` is apart (see NETWORK_J_PER_BYTE)."""

    step_s: float
    devices_busy_j: float = 0.0  # volunteer devices computing
    devices_waiting_j: float = 0.0  # volunteer devices present, awake and not computing
    devices_standby_j: float = 0.0  # volunteer devices present in standby (STANDBY_W)
    devices_increment_j: float = 0.0  # devices' increment: busy minus idle power while computing
    datacentre_j: float = 0.0  # the coordinator(s) and relays, or the cloud's nodes, times PUE
    network_j: float = 0.0
    flops: float = 0.0  # of the step, for joules per GFLOP
    grid_gco2_kwh: float = GRID_GCO2_KWH
    by_class: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    estimated: tuple[str, ...] = ()  # classes whose power is the nearest preset's

    @property
    def devices_j(self) -> float:
        return self.devices_busy_j + self.devices_waiting_j + self.devices_standby_j

    @property
    def energy_j(self) -> float:
        return self.devices_j + self.datacentre_j

    @property
    def kwh(self) -> float:
        return self.energy_j / J_PER_KWH

    @property
    def co2_g(self) -> float:
        return self.kwh * self.grid_gco2_kwh

    @property
    def j_per_gflop(self) -> float | None:
        return self.energy_j / (self.flops / 1e9) if self.flops > 0 else None

    @property
    def increment_j(self) -> float:
        """Over machines that are on anyway: the devices' increment, the datacentre whole."""
        return self.devices_increment_j + self.datacentre_j

    def as_json(self) -> dict[str, object]:
        return {
            "energy_j": self.energy_j,
            "kwh": self.kwh,
            "co2_g": self.co2_g,
            "energy_j_per_gflop": self.j_per_gflop,
            "devices_j": self.devices_j,
            "devices_busy_j": self.devices_busy_j,
            "devices_waiting_j": self.devices_waiting_j,
            "devices_standby_j": self.devices_standby_j,
            "datacentre_j": self.datacentre_j,
            "increment_j": self.increment_j,
            "increment_co2_g": self.increment_j / J_PER_KWH * self.grid_gco2_kwh,
            "increment_j_per_gflop": self.increment_j / (self.flops / 1e9) if self.flops > 0 else None,
            "devices_increment_j": self.devices_increment_j,
            "network_j": self.network_j,
            "network_co2_g": self.network_j / J_PER_KWH * self.grid_gco2_kwh,
            "by_class": {name: dict(row) for name, row in self.by_class.items()},
            "power_estimated": list(self.estimated),
        }


def _check(name: str, value: float, *, zero: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CostModelError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not zero):
        raise CostModelError(f"{name} must be {'>= 0' if zero else '> 0'}, got {value!r}")
    return float(value)


def check_pue(pue: float) -> float:
    value = _check("PUE", pue, zero=False)
    if value < 1:
        raise CostModelError(f"PUE is at least 1 (facility power over IT power), got {pue!r}")
    return value


def cleave_energy(
    fleet: Sequence[DeviceClass],
    busy_s: Mapping[str, float],
    present_s: Mapping[str, float],
    step_s: float,
    *,
    coordinator_w: float,
    coordinators: int = 1,
    relays: int = 0,
    pue: float = PUE_DEFAULT,
    flops: float = 0.0,
    network_bytes: float = 0.0,
    scale: float = 1.0,
    grid_gco2_kwh: float = GRID_GCO2_KWH,
    standby_s: Mapping[str, float] | None = None,
) -> Energy:
    """A Cleave step: each class's busy seconds at its busy power, its seconds in standby
    (``standby_s``, part of its present time) at ``STANDBY_W``, and the rest of its devices' time
    present at its idle power (each summed over its devices, from the simulator), ``scale`` times
    (a tier's rank stands for ``scale`` such shares of the fleet); plus ``coordinators``
    coordinators (and their ``relays`` each) at their power for the whole step, times ``pue``.
    On the increment: busy seconds at busy minus idle power, waiting and standby nothing, the
    coordinators and relays whole."""
    step_s = _check("step_s", step_s)
    pue = check_pue(pue)
    standby_s = standby_s or {}
    powers = {cls.name: device_power(cls) for cls in fleet}
    busy_j = waiting_j = asleep_j = increment_j = 0.0
    by_class: dict[str, dict[str, float]] = {}
    for name in sorted(set(busy_s) | set(present_s) | set(standby_s)):
        if name not in powers:
            raise CostModelError(f"class {name!r} is not in the fleet")
        power, _ = powers[name]
        busy = _check(f"{name} busy seconds", busy_s.get(name, 0.0)) * scale
        present = _check(f"{name} present seconds", present_s.get(name, 0.0)) * scale
        standby = min(_check(f"{name} standby seconds", standby_s.get(name, 0.0)) * scale, max(0.0, present - busy))
        waiting = max(0.0, present - busy - standby)
        row = {
            "busy_s": busy,
            "waiting_s": waiting,
            "standby_s": standby,
            "busy_j": busy * power.busy_w,
            "waiting_j": waiting * power.idle_w,
            "standby_j": standby * STANDBY_W,
            "increment_j": busy * power.increment_w,
        }
        by_class[name] = row
        busy_j += row["busy_j"]
        waiting_j += row["waiting_j"]
        asleep_j += row["standby_j"]
        increment_j += row["increment_j"]
    datacentre_w = coordinators * (coordinator_w + relays * RELAY_W) * pue
    return Energy(
        step_s=step_s,
        devices_busy_j=busy_j,
        devices_waiting_j=waiting_j,
        devices_standby_j=asleep_j,
        devices_increment_j=increment_j,
        datacentre_j=datacentre_w * step_s,
        network_j=_check("network bytes", network_bytes) * NETWORK_J_PER_BYTE,
        flops=_check("flops", flops),
        grid_gco2_kwh=_check("grid intensity", grid_gco2_kwh),
        by_class=by_class,
        estimated=tuple(sorted(n for n, (_, est) in powers.items() if est and n in by_class)),
    )


def cloud_energy(cloud: CloudResult, *, pue: float = PUE_DEFAULT, grid_gco2_kwh: float = GRID_GCO2_KWH) -> Energy:
    """The cloud's step: ``gpus x (board x GPU_TRAINING_POWER_SHARE + host) x PUE x step``.
    Traffic stays inside the node (NVLink): no network energy is charged. Dedicated machines: the
    increment is the whole draw."""
    node = CLOUD_POWER.get(cloud.gpu)
    if node is None:
        raise CostModelError(f"no power figures for gpu {cloud.gpu!r}; known: {', '.join(CLOUD_POWER)}")
    watts = cloud.gpus * (node.board_w * GPU_TRAINING_POWER_SHARE + node.host_w) * check_pue(pue)
    return Energy(
        step_s=cloud.step_s,
        datacentre_j=watts * cloud.step_s,
        flops=cloud.flops,
        grid_gco2_kwh=_check("grid intensity", grid_gco2_kwh),
    )


def _assign(supply: list[int], demand: list[int], cost: list[list[float | None]]) -> list[list[int]]:
    """Min-cost transportation: ``flow[c][s]`` devices of class c in seat s, every seat's demand
    met from the classes' supply, ``None`` cost meaning not allowed. Successive shortest paths
    (Bellman-Ford on the residual graph): classes and seats are few (a seat kind per stage role),
    and each augmentation moves a whole bottleneck of devices."""
    n, m = len(supply), len(demand)
    flow = [[0] * m for _ in range(n)]
    left = list(supply)
    need = list(demand)
    while sum(need) > 0:
        # Nodes: classes 0..n-1, seats n..n+m-1; from a virtual source into classes with supply.
        dist = [math.inf] * (n + m)
        prev: list[int | None] = [None] * (n + m)
        for c in range(n):
            if left[c] > 0:
                dist[c] = 0.0
        for _ in range(n + m):
            changed = False
            for c in range(n):
                for s in range(m):
                    w = cost[c][s]
                    if w is None:
                        continue
                    if dist[c] + w < dist[n + s] - 1e-12:  # forward: more of class c in seat s
                        dist[n + s], prev[n + s], changed = dist[c] + w, c, True
                    if flow[c][s] > 0 and dist[n + s] - w < dist[c] - 1e-12:  # back: take some out
                        dist[c], prev[c], changed = dist[n + s] - w, n + s, True
            if not changed:
                break
        open_seats = [s for s in range(m) if need[s] > 0 and dist[n + s] < math.inf]
        if not open_seats:
            raise CostModelError("no class may take a seat of the pipeline (the placement is infeasible)")
        seat = min(open_seats, key=lambda s: dist[n + s])
        # Walk the path back from the seat: (from, to) edges, a class -> seat edge forward (add),
        # a seat -> class edge backward (that seat gives up devices of that class).
        edges: list[tuple[int, int]] = []
        node = n + seat
        while (before := prev[node]) is not None:
            edges.append((before, node))
            node = before
        amount = min(left[node], need[seat])
        for a, b in edges:
            if a >= n:  # backward: seat a -> class b
                amount = min(amount, flow[b][a - n])
        for a, b in edges:
            if a >= n:
                flow[b][a - n] -= amount
            else:
                flow[a][b - n] += amount
        left[node] -= amount
        need[seat] -= amount
    return flow


def dtfm_energy(
    result: DtfmResult,
    fleet: Sequence[DeviceClass],
    dtype: str,
    *,
    grid_gco2_kwh: float = GRID_GCO2_KWH,
    flops: float = 0.0,
) -> Energy | None:
    """The DTFM-style step: each device of the pipeline busy for its stage's FLOP at its rate and
    waiting (bubble, transfers, all-reduce) the rest of the step; devices it does not use are not
    counted. Among the placements as fast as the chosen one, the one that costs least energy
    (in DTFM's favour). None where it does not fit. Its devices are volunteers' machines on
    anyway too: on the increment, busy minus idle power while computing, waiting nothing."""
    if result.step_s is None or not result.seats:
        return None
    classes = [cls for cls in fleet if cls.count > 0 and cls.profile.flops_per_s(dtype) > 0]
    powers = {cls.name: device_power(cls) for cls in classes}
    step = result.step_s

    def busy(cls: DeviceClass, flop: float) -> float:
        return min(step, flop / cls.profile.flops_per_s(dtype))

    def joules(cls: DeviceClass, flop: float) -> float:
        power, _ = powers[cls.name]
        b = busy(cls, flop)
        return b * power.busy_w + (step - b) * power.idle_w

    seats = result.seats
    cost = [[joules(cls, seat.flops) if cls.name in seat.classes else None for seat in seats] for cls in classes]
    flow = _assign([cls.count for cls in classes], [seat.devices for seat in seats], cost)
    busy_j = waiting_j = increment_j = 0.0
    by_class: dict[str, dict[str, float]] = {}
    for c, cls in enumerate(classes):
        power, _ = powers[cls.name]
        b = sum(flow[c][s] * busy(cls, seat.flops) for s, seat in enumerate(seats))
        devices = sum(flow[c])
        if not devices:
            continue
        w = devices * step - b
        by_class[cls.name] = {
            "devices": float(devices),
            "busy_s": b,
            "waiting_s": w,
            "busy_j": b * power.busy_w,
            "waiting_j": w * power.idle_w,
            "increment_j": b * power.increment_w,
        }
        busy_j += b * power.busy_w
        waiting_j += w * power.idle_w
        increment_j += b * power.increment_w
    return Energy(
        step_s=step,
        devices_busy_j=busy_j,
        devices_waiting_j=waiting_j,
        devices_increment_j=increment_j,
        network_j=sum(seat.devices * seat.bytes_sent for seat in seats) * NETWORK_J_PER_BYTE,
        flops=_check("flops", flops),
        grid_gco2_kwh=_check("grid intensity", grid_gco2_kwh),
        by_class=by_class,
        estimated=tuple(sorted(n for n, (_, est) in powers.items() if est and n in by_class)),
    )


def constants() -> Iterable[tuple[str, float, str]]:
    """The scalar constants, for reports and the docs' table test: (name, value, unit)."""
    return (
        ("GRID_GCO2_KWH", GRID_GCO2_KWH, "gCO2e/kWh"),
        ("PUE_DEFAULT", PUE_DEFAULT, ""),
        ("PUE_INDUSTRY_AVERAGE", PUE_INDUSTRY_AVERAGE, ""),
        ("NETWORK_J_PER_BYTE", NETWORK_J_PER_BYTE, "J/byte"),
        ("SERVER_W", SERVER_W, "W"),
        ("RELAY_W", RELAY_W, "W"),
        ("STANDBY_W", STANDBY_W, "W"),
    )
