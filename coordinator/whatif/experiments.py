"""What ``cleave plan`` and ``cleave simulate`` run, for the commands and bench/ alike: the
coordinator they price (its preset, relays, loops), the fleet as it is simulated, the planner's
step beside the round-robin baseline, and at each device count the simulation's two runs (calm,
and with churn and one injected crash) beside the DTFM-style and cloud baselines.

These return what ran; report.py turns it into the ``--json`` documents. The bounds here are the
experiments' own (what each can price in reasonable time); the commands check their options
against them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from cleave.coordinator.engine.energy import GRID_GCO2_KWH
from cleave.coordinator.engine.live_plan import Planner
from cleave.coordinator.engine.scheduler import FaultPolicy
from cleave.coordinator.planning.costmodel import (
    ADAMW_BYTES,
    ATTENTION_PASSES,
    ITEMSIZE,
    MAX_PS_GFLOPS,
    CostModelError,
    DeviceClass,
    PSProfile,
)
from cleave.coordinator.planning.planner import Gemm, Plan, StepPlan, baseline, plan_step
from cleave.coordinator.planning.tier import SOLO, Tier
from cleave.coordinator.whatif.baselines import (
    CloudResult,
    DtfmResult,
    bytes_per_param,
    cloud_step,
    dtfm_step,
    step_flops,
)
from cleave.coordinator.whatif.energy import (
    COORDINATOR_POWER,
    PUE_DEFAULT,
    Energy,
    cleave_energy,
    cloud_energy,
    dtfm_energy,
)
from cleave.coordinator.whatif.presets import ModelShape, coordinator_preset, model_shape, resolve_fleet, step_gemms
from cleave.coordinator.whatif.runs import run_all
from cleave.coordinator.whatif.simulator import SimConfig, SimResult
from cleave.wire.errors import ConfigError


class DType(str, Enum):
    """The dtypes a step trains in."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


# The round-robin baseline is priced device by device and tile by tile (O(devices + tiles) per
# GEMM, in time and memory), so a fleet or a batch far past these would take minutes or exhaust
# memory before the planner, which is O(classes), has any difficulty.
PLAN_MAX_DEVICES = 1_000_000
MAX_BATCH = 65_536
SIMULATE_MAX_DEVICES = 100_000  # every device is simulated one by one (its links, its leases)
FAIL_SHARE = 0.5  # the injected crash comes once this share of the last step's GEMMs is submitted

DEFAULT_LINK_GBPS = 10.0
DEFAULT_RELAY_GBPS = 10.0  # a university server or a cloud VM
DEFAULT_RELAY_GB = 16.0
MAX_RELAYS = 10_000
MAX_PS_WORKERS = 1024

# --------------------------------------------------------------------------- the coordinator


def default_ps(link_gbps: float) -> PSProfile:
    """A server-class PS (PSProfile's documented defaults, docs/cost-model.md) at ``link_gbps``
    both ways; its own work in every dtype at its fp32 rate (it can always upcast what it
    computes itself: local GEMMs, attention)."""
    return coordinator_ps("server", link_gbps)


def coordinator_ps(name: str, link_gbps: float, gflops: float | None = None) -> PSProfile:
    """``--coordinator`` on ``--ps-link-gbps``, its GEMM rate set by ``--ps-gflops`` if given."""
    if gflops is not None and not (math.isfinite(gflops) and 0 < gflops <= MAX_PS_GFLOPS):
        raise ConfigError(f"--ps-gflops must be above 0 and at most {MAX_PS_GFLOPS:,.0f}, got {gflops}")
    try:
        return coordinator_preset(name, link_gbps, gflops)
    except CostModelError as exc:
        raise ConfigError(str(exc)) from None


def with_relays(ps: PSProfile, relays: int, link_gbps: float, memory_gb: float) -> PSProfile:
    """``ps`` with ``--relays`` relays on ``--relay-link-gbps`` links, caching ``--relay-memory-gb``."""
    if not 0 <= relays <= MAX_RELAYS:
        raise ConfigError(f"--relays must be between 0 and {MAX_RELAYS:,}, got {relays}")
    if not (math.isfinite(link_gbps) and 0 < link_gbps <= 1e6):
        raise ConfigError(f"--relay-link-gbps must be above 0 and at most 1,000,000, got {link_gbps}")
    if not (math.isfinite(memory_gb) and 0 < memory_gb <= 1e6):
        raise ConfigError(f"--relay-memory-gb must be above 0 and at most 1,000,000, got {memory_gb}")
    return dataclasses.replace(ps, relays=relays, relay_egress=link_gbps * 1e9 / 8, relay_memory=memory_gb * 1e9)


def with_workers(ps: PSProfile, workers: int) -> PSProfile:
    """``ps`` with ``--ps-workers`` loops and verifiers sharing the work."""
    if isinstance(workers, bool) or not 1 <= workers <= MAX_PS_WORKERS:
        raise ConfigError(f"--ps-workers must be between 1 and {MAX_PS_WORKERS:,}, got {workers}")
    return dataclasses.replace(ps, workers=workers)


def ps_other_seconds(
    model: ModelShape, batch: int, seq: int, dtype: str, ps: PSProfile, tier: Tier = SOLO
) -> tuple[float, float]:
    """Seconds of the PS's own work besides the GEMMs it hands out: (attention, AdamW), for
    ``batch`` sequences (a rank's slice on a tier, with AdamW on its share of the parameters).
    Element-wise work (norms, activations, softmax, residuals, loss) is not counted."""
    rate = ps.flops_per_s(dtype)
    if rate <= 0:
        raise CostModelError(f"the parameter server cannot compute in {dtype}")
    attention = ATTENTION_PASSES * model.attention_flops(batch, seq) / rate
    per_param = ADAMW_BYTES + (ITEMSIZE[dtype] if dtype != DType.FP32.value else 0)
    return attention, tier.optimizer_share(model.parameter_sizes()) * per_param / ps.optimizer_bw


# --------------------------------------------------------------------------- the fleet and the setup


def rank_fleet(fleet: Sequence[DeviceClass], tier: Tier) -> tuple[DeviceClass, ...]:
    """The devices of the tier's slowest rank (each class dealt out round-robin)."""
    share = tuple(DeviceClass(c.name, tier.share(c.count), c.profile) for c in fleet if tier.share(c.count))
    if not share:
        raise ConfigError(f"{tier.ranks} coordinators leave the slowest of them no devices")
    return share


def adjust_fleet(
    classes: tuple[DeviceClass, ...], *, down_up_ratio: float | None, wire_half: bool, dtype: str
) -> tuple[DeviceClass, ...]:
    """``--down-up-ratio``: every class's uplink becomes its downlink over the ratio.
    ``--wire-half``: blocks and results travel in 2 bytes while devices compute in fp32 (their
    fp32 rate is what the half dtype runs at)."""
    out = []
    for cls in classes:
        p = cls.profile
        if down_up_ratio is not None:
            p = dataclasses.replace(p, up=p.down / down_up_ratio)
        if wire_half:
            p = dataclasses.replace(p, gflops={**p.gflops, dtype: p.gflops.get("fp32", 0.0)})
        out.append(DeviceClass(cls.name, cls.count, p))
    return tuple(out)


def checked_model(name: str, seq: int) -> ModelShape:
    """The model preset ``name``, which must have ``seq`` positions."""
    model = model_shape(name)
    if seq > model.max_seq_len:
        raise ConfigError(f"--seq-len {seq} exceeds {model.name}'s {model.max_seq_len} positions")
    return model


@dataclass(frozen=True)
class Setup:
    """What every experiment prices: a model preset on a fleet (a preset or a TOML file, at
    ``devices`` or its own counts; docs/presets.md), trained by a coordinator of profile ``ps``
    (built from the ``coordinator`` preset on a ``link_gbps`` link) alone or in a tier, one step
    of ``batch`` sequences of ``seq`` tokens in ``dtype``."""

    model: str
    fleet: str
    devices: int | None
    ps: PSProfile
    link_gbps: float = DEFAULT_LINK_GBPS
    coordinator: str = "server"
    tier: Tier = SOLO
    batch: int = 8  # the whole batch; on a tier, each rank trains tier.slice(batch)
    seq: int = 256
    dtype: str = DType.FP32.value


# --------------------------------------------------------------------------- cleave plan


@dataclass(frozen=True)
class PlanRun:
    """One step planned on a fleet (on a tier: its slowest rank's) and the round-robin baseline
    of each of its GEMMs (None where no device can multiply in the dtype)."""

    setup: Setup
    model: ModelShape
    devices: int  # the whole fleet's
    fleet: tuple[DeviceClass, ...]  # the planned rank's
    step: StepPlan
    baselines: list[Plan | None]
    attention_s: float
    optimizer_s: float
    collectives_s: float  # the gradients' reduce-scatter and the weights' all-gather, per step


def step_inputs(model: ModelShape, batch: int, seq: int, dtype: str) -> list[tuple[Gemm, int]]:
    """The step's GEMMs for the planner. No row/k pieces: ``cleave plan`` lets each GEMM choose
    its own cut, where the live scheduler may align dW's reduction with forward's rows."""
    return [(Gemm(g.m, g.n, g.k, dtype, g.kind, f"{g.layer}.{g.kind}"), g.count) for g in step_gemms(model, batch, seq)]


def _baselines(
    step: StepPlan, fleet: Sequence[DeviceClass], ps: PSProfile, progress: Callable[[int, int], None]
) -> list[Plan | None]:
    # The label is only a name: same-shaped GEMMs (q and o, fc1.fwd and fc2.dx) share one pricing.
    cache: dict[Gemm, Plan | None] = {}
    out = []
    for i, (plan, _) in enumerate(step.plans):
        key = dataclasses.replace(plan.gemm, label="")
        if key not in cache:
            progress(i, len(step.plans))
            cache[key] = baseline(key, fleet, ps)
        out.append(cache[key])
    return out


def plan_fleet(setup: Setup, progress: Callable[[str], None] = lambda _: None) -> PlanRun:
    """Plan one step and price the round-robin baseline. On a tier, the step is its slowest
    rank's: its slice of the batch on its share of the fleet, the tier's collectives and AdamW on
    its share of the parameters."""
    u, ps, tier = setup, setup.ps, setup.tier
    model = checked_model(u.model, u.seq)
    whole = resolve_fleet(u.fleet, u.dtype, u.devices)
    total = sum(cls.count for cls in whole)
    if total > PLAN_MAX_DEVICES:
        raise ConfigError(f"the fleet has {total:,} devices; cleave plan prices at most {PLAN_MAX_DEVICES:,}")
    fleet = rank_fleet(whole, tier)
    batch = tier.slice(u.batch)
    attention, optimizer = ps_other_seconds(model, batch, u.seq, u.dtype, ps, tier)
    sizes = model.parameter_sizes()
    collectives = tier.reduce_seconds(sizes, ps.memory_bw) + tier.gather_seconds(sizes)
    where = f"{total:,} devices" if tier.ranks == 1 else f"one of {tier.ranks} coordinators' share of {total:,} devices"
    progress(f"planning {model.name} on {where} ...")
    step = plan_step(
        step_inputs(model, batch, u.seq, u.dtype), fleet, ps, ps_other_seconds=attention + optimizer + collectives
    )
    bases = _baselines(step, fleet, ps, lambda i, n: progress(f"pricing the round-robin baseline ({i + 1}/{n}) ..."))
    return PlanRun(u, model, total, fleet, step, bases, attention, optimizer, collectives)


# --------------------------------------------------------------------------- cleave simulate


@dataclass(frozen=True)
class Settings:
    """What ``cleave simulate`` holds the same at every device count. The simulation moves
    blocks in ``wire`` and the baselines train in the setup's dtype (bf16 on the wire is
    Cleave's lever, not theirs). ``down_up_ratio`` and ``wire_half`` shape the fleet
    (``fleet_at``); ``simulate_one`` takes its fleet as given."""

    setup: Setup
    seed: int = 0
    steps: int = 1
    planner: Planner = Planner.COST
    churn: bool = True
    heartbeat_timeout: float = FaultPolicy().heartbeat_timeout
    wire_half: bool = False  # blocks and results travel in bf16 (fp32 training only)
    down_up_ratio: float | None = None
    micro_batches: int = 1  # 0: auto, the cost model's choice
    batched: bool = False
    pue: float = PUE_DEFAULT  # the datacentres' (coordinator/whatif/energy.py)
    grid_gco2_kwh: float = GRID_GCO2_KWH

    @property
    def wire(self) -> str:
        return "bf16" if self.wire_half else self.setup.dtype


@dataclass(frozen=True)
class FleetRun:
    """One device count: the simulation's calm run and its run with churn and one crash, both
    baselines, and the energy of a step of each system."""

    settings: Settings
    model: ModelShape
    classes: tuple[DeviceClass, ...]
    calm: SimResult
    stormy: SimResult
    dtfm: DtfmResult
    dtfm_recovery_s: float | None
    cloud: CloudResult
    energy: Energy
    dtfm_energy: Energy | None  # None: DTFM cannot place the model
    cloud_energy: Energy
    devices_per_rank: int  # on a tier: the slowest rank's devices, the share the simulation ran
    wall_s: float

    @property
    def devices(self) -> int:
        return sum(c.count for c in self.classes)


def fleet_at(count: int | None, settings: Settings) -> tuple[DeviceClass, ...]:
    """The fleet ``cleave simulate`` runs at ``count`` devices (None: the setup's own)."""
    classes = resolve_fleet(settings.setup.fleet, settings.setup.dtype, count)
    if sum(c.count for c in classes) > SIMULATE_MAX_DEVICES:
        raise ConfigError(
            f"the fleet has {sum(c.count for c in classes):,} devices; cleave simulate runs at most "
            f"{SIMULATE_MAX_DEVICES:,}"
        )
    return adjust_fleet(
        classes, down_up_ratio=settings.down_up_ratio, wire_half=settings.wire_half, dtype=settings.wire
    )


def simulate_one(
    classes: tuple[DeviceClass, ...], settings: Settings, progress: Callable[[str], None] = lambda _: None
) -> FleetRun:
    """Simulate the setup's model on ``classes`` and price the baselines. On a tier, the
    simulation is its slowest rank (the batch's slice, its share of the fleet); the baselines
    train the whole batch on the whole fleet. Each of the three carries the step's energy
    (coordinator/whatif/energy.py)."""
    s, u = settings, settings.setup
    model = model_shape(u.model)
    devices = sum(c.count for c in classes)
    base = SimConfig(
        model, classes, u.ps, batch=u.batch, seq=u.seq, dtype=s.wire, seed=s.seed, steps=s.steps, planner=s.planner,
        faults=FaultPolicy(heartbeat_timeout=s.heartbeat_timeout), churn=False, micro_batches=s.micro_batches,
        batched=s.batched, tier=u.tier,
    )  # fmt: skip
    started = time.perf_counter()
    where = f"{devices:,} devices"
    if u.tier.ranks > 1:
        where = f"one of {u.tier.ranks} coordinators' share of {where}"
    # Two runs side by side (coordinator/whatif/runs.py): without churn, to price the stalls
    # churn causes, and with churn and one crash on the busiest device, halfway through the
    # last step's GEMMs, to measure recovery. Both choose the same micro-batches (the same fleet
    # at the first step).
    stormy_cfg = dataclasses.replace(base, churn=s.churn, fail_share=FAIL_SHARE)
    names = ("no churn", "churn, one crash" if s.churn else "one crash")
    lines = ["starting", "starting"]

    def tell(index: int, line: str) -> None:
        lines[index] = line
        progress(f"simulating {model.name} on {where}: " + "; ".join(f"{n}: {t}" for n, t in zip(names, lines)))

    progress(f"simulating {model.name} on {where} ({names[0]}; {names[1]}) ...")
    calm, stormy = run_all([base, stormy_cfg], tell)
    wall = time.perf_counter() - started
    dtfm = dtfm_step(model, classes, u.batch, u.seq, u.dtype)
    cloud = cloud_step(model, u.batch, u.seq, u.dtype)
    recovery = None
    if dtfm.step_s is not None and dtfm.stages:
        # DTFM has no per-tile recovery: a lost stage device stalls its pipeline until it is seen
        # (the same heartbeat timeout), a replacement downloads its stage's training state (weights,
        # gradients, Adam: bytes_per_param per parameter) over the fastest downlink in the fleet,
        # and the step runs again (on average half of it was lost). Every choice favours DTFM.
        fastest_down = max(c.profile.down for c in classes if c.count)
        state = bytes_per_param(u.dtype) * model.params / dtfm.stages
        recovery = s.heartbeat_timeout + state / fastest_down + dtfm.step_s / 2
    # Energy: the simulated rank's devices stand for the whole fleet's (``scale`` such shares).
    flops = step_flops(model, u.batch, u.seq)
    per_rank = sum(u.tier.share(c.count) for c in classes)
    scale = devices / per_rank if per_rank else 1.0
    measured = stormy.measured
    busy: dict[str, float] = {}
    present: dict[str, float] = {}
    asleep: dict[str, float] = {}
    for m in measured:
        for name, v in m.class_standby_s.items():
            asleep[name] = asleep.get(name, 0.0) + v / len(measured)
        for name, v in m.class_busy_s.items():
            busy[name] = busy.get(name, 0.0) + v / len(measured)
        for name, v in m.class_present_s.items():
            present[name] = present.get(name, 0.0) + v / len(measured)
    moved = sum(m.egress_bytes + m.ingress_bytes + m.relay_bytes for m in measured) / len(measured)
    energy = cleave_energy(
        classes,
        busy,
        present,
        stormy.step_s,
        coordinator_w=COORDINATOR_POWER[u.coordinator],
        coordinators=u.tier.ranks,
        relays=u.ps.relays,
        pue=s.pue,
        flops=flops,
        network_bytes=moved * u.tier.ranks,
        scale=scale,
        grid_gco2_kwh=s.grid_gco2_kwh,
        standby_s=asleep,
    )
    dtfm_e = dtfm_energy(dtfm, classes, u.dtype, flops=flops, grid_gco2_kwh=s.grid_gco2_kwh)
    cloud_e = cloud_energy(cloud, pue=s.pue, grid_gco2_kwh=s.grid_gco2_kwh)
    return FleetRun(s, model, classes, calm, stormy, dtfm, recovery, cloud, energy, dtfm_e, cloud_e, per_rank, wall)


def simulate_counts(
    counts: Sequence[int | None], settings: Settings, progress: Callable[[str], None] = lambda _: None
) -> list[FleetRun]:
    """``cleave simulate``'s runs: one per device count of a sweep (None: the fleet's own)."""
    checked_model(settings.setup.model, settings.setup.seq)
    return [simulate_one(fleet_at(n, settings), settings, progress) for n in counts]
