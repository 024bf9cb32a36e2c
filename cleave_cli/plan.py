"""``cleave plan``: how the cost model would cut every GEMM of one training step over a fleet.

Pure planning (coordinator/planning/planner.py) over named inputs (coordinator/whatif/presets.py); this module
only picks the parameter server's profile, prices the PS's own non-GEMM work, and turns the
plans into one JSON-ready report that the table (render.plan_report) and ``--json`` share.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Annotated, Any

import typer
from rich.console import Console

from cleave.cli import render
from cleave.cli.errors import friendly, is_terminal, stderr_console
from cleave.coordinator.planning.costmodel import (
    ADAMW_BYTES,
    ATTENTION_PASSES,
    ITEMSIZE,
    MAX_PS_GFLOPS,
    CostModelError,
    DeviceClass,
    PSProfile,
)
from cleave.coordinator.planning.planner import Gemm, Kind, Plan, StepPlan, baseline, plan_step
from cleave.coordinator.planning.tier import DEFAULT_TIER_GBPS, MAX_RANKS, SOLO, Tier
from cleave.coordinator.whatif.presets import (
    COORDINATORS,
    FLEETS,
    MODELS,
    ModelShape,
    coordinator_preset,
    model_shape,
    resolve_fleet,
    step_gemms,
)
from cleave.wire.errors import ConfigError


class DType(str, Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


# The round-robin baseline is priced device by device and tile by tile (O(devices + tiles) per
# GEMM, in time and memory), so a fleet or a batch far past these would take minutes or exhaust
# memory before the planner, which is O(classes), has any difficulty.
MAX_DEVICES = 1_000_000
MAX_BATCH = 65_536

DEFAULT_LINK_GBPS = 10.0


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


def tier_of(coordinators: int, tier_link_gbps: float, batch_size: int) -> Tier:
    """``--coordinators`` on ``--tier-link-gbps``, checked against the batch they cut."""
    if not 1 <= coordinators <= MAX_RANKS:
        raise ConfigError(f"--coordinators must be between 1 and {MAX_RANKS}, got {coordinators}")
    if not (math.isfinite(tier_link_gbps) and 0 < tier_link_gbps <= 1e6):
        raise ConfigError(f"--tier-link-gbps must be above 0 and at most 1,000,000, got {tier_link_gbps}")
    if batch_size % coordinators:
        raise ConfigError(
            f"--batch-size {batch_size} does not cut into {coordinators} equal slices, one per coordinator"
        )
    return Tier.from_gbps(coordinators, tier_link_gbps)


def rank_fleet(fleet: Sequence[DeviceClass], tier: Tier) -> tuple[DeviceClass, ...]:
    """The devices of the tier's slowest rank (each class dealt out round-robin)."""
    share = tuple(DeviceClass(c.name, tier.share(c.count), c.profile) for c in fleet if tier.share(c.count))
    if not share:
        raise ConfigError(f"{tier.ranks} coordinators leave the slowest of them no devices")
    return share


def step_inputs(model: ModelShape, batch: int, seq: int, dtype: str) -> list[tuple[Gemm, int]]:
    """The step's GEMMs for the planner. No row/k pieces: ``cleave plan`` lets each GEMM choose
    its own cut, where the live scheduler may align dW's reduction with forward's rows."""
    return [(Gemm(g.m, g.n, g.k, dtype, g.kind, f"{g.layer}.{g.kind}"), g.count) for g in step_gemms(model, batch, seq)]


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


def _finite(value: float) -> float | None:
    """JSON has no Infinity or NaN: an impossible time is null."""
    return float(value) if math.isfinite(value) else None


def _ratio(num: float | None, den: float) -> float | None:
    return _finite(num / den) if num is not None and den > 0 else None


def _class_json(cls: DeviceClass, dtype: str) -> dict[str, Any]:
    p = cls.profile
    return {
        "name": cls.name,
        "count": cls.count,
        "gflops": p.gflops.get(dtype, 0.0),
        "memory": p.memory,
        "down": p.down,
        "up": p.up,
        "rtt": p.rtt,
        "session": _finite(p.session),
        "reliability": p.reliability,
    }


def _gemm_json(plan: Plan, count: int, base: Plan | None) -> dict[str, Any]:
    g = plan.gemm
    layer, _, kind = g.label.rpartition(".")
    return {
        "layer": layer,
        "kind": kind,
        "m": g.m,
        "n": g.n,
        "k": g.k,
        "count": count,
        "partition": plan.kind.value,
        "grid": list(plan.grid),
        "seconds": _finite(plan.seconds),
        "devices": plan.devices,
        "units": plan.units,
        "bound": plan.bound,
        "compute_seconds": plan.compute_seconds,
        "down_seconds": plan.down_seconds,
        "up_seconds": plan.up_seconds,
        "ps_seconds": plan.ps_seconds,
        "egress_bytes": plan.egress_bytes,
        "ingress_bytes": plan.ingress_bytes,
        "egress_floor_bytes": plan.egress_floor,
        "baseline_seconds": _finite(base.seconds) if base is not None else None,
        "baseline_grid": list(base.grid) if base is not None else None,
        "shares": [
            {
                "class": s.name,
                "devices": s.devices,
                "pieces": s.pieces,
                "per_device": s.per_device,
                "units": s.units,
                "memory_bytes": s.memory,
                "seconds": _finite(s.seconds),
                "down_bytes": s.down_bytes,
                "up_bytes": s.up_bytes,
            }
            for s in plan.shares
        ],
    }


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


def build_report(
    model_name: str,
    fleet_spec: str,
    devices: int | None,
    link_gbps: float,
    batch: int,
    seq: int,
    dtype: str,
    progress: Callable[[str], None] = lambda _: None,
    *,
    coordinator: str = "server",
    ps_gflops: float | None = None,
    tier: Tier = SOLO,
    ps_workers: int = 1,
) -> dict[str, Any]:
    """Plan one step and price the round-robin baseline; the JSON object of ``--json``. On a
    tier, the step is its slowest rank's: its slice of the batch on its share of the fleet, the
    tier's collectives and AdamW on its share of the parameters."""
    model = model_shape(model_name)
    if seq > model.max_seq_len:
        raise ConfigError(f"--seq-len {seq} exceeds {model.name}'s {model.max_seq_len} positions")
    whole = resolve_fleet(fleet_spec, dtype, devices)
    total = sum(cls.count for cls in whole)
    if total > MAX_DEVICES:
        raise ConfigError(f"the fleet has {total:,} devices; cleave plan prices at most {MAX_DEVICES:,}")
    ps = with_workers(coordinator_ps(coordinator, link_gbps, ps_gflops), ps_workers)
    fleet = rank_fleet(whole, tier)
    global_batch, batch = batch, tier.slice(batch)
    attention, optimizer = ps_other_seconds(model, batch, seq, dtype, ps, tier)
    sizes = model.parameter_sizes()
    collectives = tier.reduce_seconds(sizes, ps.memory_bw) + tier.gather_seconds(sizes)
    where = f"{total:,} devices" if tier.ranks == 1 else f"one of {tier.ranks} coordinators' share of {total:,} devices"
    progress(f"planning {model.name} on {where} ...")
    step = plan_step(
        step_inputs(model, batch, seq, dtype), fleet, ps, ps_other_seconds=attention + optimizer + collectives
    )
    bases = _baselines(step, fleet, ps, lambda i, n: progress(f"pricing the round-robin baseline ({i + 1}/{n}) ..."))
    base_step: float | None = None  # null when no device can multiply in the dtype
    if all(b is not None for b in bases):
        base_gemm = sum(b.seconds * count for b, (_, count) in zip(bases, step.plans) if b is not None)
        base_step = _finite(base_gemm + step.ps_other_seconds)  # inf: a tile fits no device's memory
    by_bound = {bound: 0.0 for bound in ("compute", "down", "up", "ps", "loop")}
    for plan, count in step.plans:
        by_bound[plan.bound] += plan.seconds * count
    # StepPlan.utilisation counts the GEMMs the PS keeps (local) as if the fleet did them.
    offloaded = sum(plan.gemm.flops * count for plan, count in step.plans if plan.kind is not Kind.LOCAL)
    classes = []
    for cls in fleet:
        shares = [s for plan, _ in step.plans for s in plan.shares if s.name == cls.name]
        classes.append(
            {
                "name": cls.name,
                "count": cls.count,
                "used": max((s.devices for s in shares), default=0),
                "memory_bytes": max((s.memory for s in shares), default=0),
                "budget_bytes": cls.profile.memory,
            }
        )
    return {
        "model": {"name": model.name, "params": model.params, "layers": model.n_layers, "d_model": model.d_model},
        "fleet": {
            "spec": fleet_spec,
            "devices": total,
            "gflops": step.fleet_flops / 1e9,
            "classes": [_class_json(cls, dtype) for cls in fleet],
        },
        "coordinators": tier.ranks,
        "tier": {
            "link_gbps": tier.link * 8 / 1e9,
            "devices_per_rank": sum(cls.count for cls in fleet),
            "batch_per_rank": batch,
            "seconds": collectives,  # the gradients' reduce-scatter and the weights' all-gather, per step
        },
        "ps": {
            "preset": coordinator,
            "link_gbps": link_gbps,
            "egress": ps.egress,
            "ingress": ps.ingress,
            "gflops": ps.gflops[dtype],
            "verify_gflops": ps.verify_flops / 1e9,
            "memory_bw": ps.memory_bw,
            "unit_overhead": ps.unit_overhead,
            "check_columns": ps.check_columns,
            "workers": ps.workers,
        },
        "batch_size": global_batch,
        "seq_len": seq,
        "tokens": global_batch * seq,
        "dtype": dtype,
        "step": {
            "seconds": step.seconds,
            "tokens_per_s": global_batch * seq / step.seconds,
            "gemm_seconds": step.gemm_seconds,
            "ps_other_seconds": step.ps_other_seconds,
            "attention_seconds": attention,
            "optimizer_seconds": optimizer,
            "tier_seconds": collectives,
            "compute_seconds": step.total("compute_seconds"),
            "down_seconds": step.total("down_seconds"),
            "up_seconds": step.total("up_seconds"),
            "ps_seconds": step.total("ps_seconds"),
            "seconds_by_bound": by_bound,
            "flops": step.flops,
            "offloaded_flops": offloaded,
            "utilisation": step.utilisation,
            "fleet_utilisation": _ratio(offloaded, step.seconds * step.fleet_flops) or 0.0,
            "devices": max((plan.devices for plan, _ in step.plans), default=0),
            "egress_bytes": step.total("egress_bytes"),
            "ingress_bytes": step.total("ingress_bytes"),
            "egress_floor_bytes": step.total("egress_floor"),
            "baseline_seconds": base_step,
            "speedup": _ratio(base_step, step.seconds),
        },
        "gemms": [_gemm_json(plan, count, base) for (plan, count), base in zip(step.plans, bases)],
        "classes": classes,
    }


# Options of the commands that price a model on a fleet (cleave plan, cleave simulate).
ModelPreset = Annotated[str, typer.Option("--model", help=f"Model preset: {', '.join(MODELS)}.")]
FleetSpec = Annotated[
    str, typer.Option("--fleet", help=f"Fleet preset ({', '.join(FLEETS)}) or a TOML fleet file (docs/presets.md).")
]
Devices = Annotated[
    int | None,
    typer.Option("--devices", help="Rescale the fleet to N devices, keeping its proportions. Default: its own counts."),
]
PsLinkGbps = Annotated[float, typer.Option("--ps-link-gbps", help="The parameter server's link in Gbit/s, each way.")]
BatchSize = Annotated[int, typer.Option("--batch-size", help="Sequences per step.")]
SeqLen = Annotated[int, typer.Option("--seq-len", help="Tokens per sequence (at most the model's positions).")]
DTypeName = Annotated[str, typer.Option("--dtype", help="Training dtype: fp32, bf16 or fp16.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print one JSON object with stable keys.")]
CoordinatorPreset = Annotated[
    str,
    typer.Option(
        "--coordinator",
        help=f"What each coordinator runs on: {', '.join(COORDINATORS)} (docs/presets.md). --ps-gflops overrides "
        "its GEMM rate.",
    ),
]
Coordinators = Annotated[
    int,
    typer.Option(
        "--coordinators",
        help="Coordinators training the batch together (a tier, docs/operations.md): each its slice of the batch "
        "on its share of the fleet, with its own --ps-gflops and --ps-link-gbps.",
    ),
]
TierLinkGbps = Annotated[
    float, typer.Option("--tier-link-gbps", help="Each coordinator's link to the others in Gbit/s, each way.")
]
Relays = Annotated[
    int,
    typer.Option(
        "--relays",
        help="Relays per coordinator (cleave relay): each takes a block from the coordinator once and serves it "
        "to its devices; every device sits behind one.",
    ),
]
RelayLinkGbps = Annotated[float, typer.Option("--relay-link-gbps", help="Each relay's link in Gbit/s, each way.")]
RelayMemoryGb = Annotated[float, typer.Option("--relay-memory-gb", help="Each relay's block cache in GB.")]
DEFAULT_RELAY_GBPS = 10.0  # a university server or a cloud VM
DEFAULT_RELAY_GB = 16.0
MAX_RELAYS = 10_000


def with_relays(ps: PSProfile, relays: int, link_gbps: float, memory_gb: float) -> PSProfile:
    """``ps`` with ``--relays`` relays on ``--relay-link-gbps`` links, caching ``--relay-memory-gb``."""
    if not 0 <= relays <= MAX_RELAYS:
        raise ConfigError(f"--relays must be between 0 and {MAX_RELAYS:,}, got {relays}")
    if not (math.isfinite(link_gbps) and 0 < link_gbps <= 1e6):
        raise ConfigError(f"--relay-link-gbps must be above 0 and at most 1,000,000, got {link_gbps}")
    if not (math.isfinite(memory_gb) and 0 < memory_gb <= 1e6):
        raise ConfigError(f"--relay-memory-gb must be above 0 and at most 1,000,000, got {memory_gb}")
    return dataclasses.replace(ps, relays=relays, relay_egress=link_gbps * 1e9 / 8, relay_memory=memory_gb * 1e9)


PsGflops = Annotated[
    float | None,
    typer.Option("--ps-gflops", help="The parameter server's own GEMM rate (GFLOP/s). Default: the --coordinator's."),
]
MAX_PS_WORKERS = 1024
PsWorkers = Annotated[
    int,
    typer.Option(
        "--ps-workers",
        help="What-if: event loops and verifiers sharing the coordinator's work (PSProfile.workers; "
        "the coordinator runs 1 of each, with send threads beside its loop).",
    ),
]


def with_workers(ps: PSProfile, workers: int) -> PSProfile:
    """``ps`` with ``--ps-workers`` loops and verifiers sharing the work."""
    if isinstance(workers, bool) or not 1 <= workers <= MAX_PS_WORKERS:
        raise ConfigError(f"--ps-workers must be between 1 and {MAX_PS_WORKERS:,}, got {workers}")
    return dataclasses.replace(ps, workers=workers)


def check_options(
    dtype: str, devices: int | None, batch_size: int, seq_len: int, ps_link_gbps: float, max_devices: int = MAX_DEVICES
) -> None:
    """The shared options' bounds, as one-line usage errors."""
    if dtype not in {d.value for d in DType}:
        raise ConfigError(f"unknown --dtype {dtype!r}; use one of {', '.join(d.value for d in DType)}")
    if devices is not None and not 1 <= devices <= max_devices:
        raise ConfigError(f"--devices must be between 1 and {max_devices:,}, got {devices}")
    if not 1 <= batch_size <= MAX_BATCH:
        raise ConfigError(f"--batch-size must be between 1 and {MAX_BATCH:,}, got {batch_size}")
    if seq_len < 1:
        raise ConfigError(f"--seq-len must be at least 1, got {seq_len}")
    if not (math.isfinite(ps_link_gbps) and 0 < ps_link_gbps <= 1e6):
        raise ConfigError(f"--ps-link-gbps must be above 0 and at most 1,000,000, got {ps_link_gbps}")


@friendly
def plan(
    model: ModelPreset = "small",
    fleet: FleetSpec = "laptops",
    devices: Devices = None,
    ps_link_gbps: PsLinkGbps = DEFAULT_LINK_GBPS,
    ps_gflops: PsGflops = None,
    ps_workers: PsWorkers = 1,
    coordinator: CoordinatorPreset = "server",
    coordinators: Coordinators = 1,
    tier_link_gbps: TierLinkGbps = DEFAULT_TIER_GBPS,
    batch_size: BatchSize = 8,
    seq_len: SeqLen = 256,
    dtype: DTypeName = DType.FP32.value,
    as_json: AsJson = False,
) -> None:
    """Predict how every GEMM of one training step would be cut over a fleet, the step's time,
    traffic and memory, and the speedup over round-robin tiles."""
    check_options(dtype, devices, batch_size, seq_len, ps_link_gbps)
    tier = tier_of(coordinators, tier_link_gbps, batch_size)
    # Transient: a terminal sees it while the baseline is priced, a pipe or a file never does.
    with stderr_console().status("planning ...") as status:
        report = build_report(
            model,
            fleet,
            devices,
            ps_link_gbps,
            batch_size,
            seq_len,
            dtype,
            status.update,
            coordinator=coordinator,
            ps_gflops=ps_gflops,
            tier=tier,
            ps_workers=ps_workers,
        )
    if as_json:
        Console(highlight=False).out(json.dumps(report, sort_keys=True, allow_nan=False))
        return
    # The GEMM table wants ~150 columns; rich assumes 80 when writing to a pipe or a file.
    wide = is_terminal() or "COLUMNS" in os.environ
    Console(highlight=False, width=None if wide else 160).print(render.plan_report(report))
