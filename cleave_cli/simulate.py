"""``cleave simulate``: what a fleet would do with a model, before anyone is recruited.

The simulation itself is coordinator/whatif/simulator.py (the live scheduler and planner on a virtual
clock); the baselines are coordinator/whatif/baselines.py. This module picks the inputs, runs the
simulation (twice: without churn, to price the stalls churn causes, and with churn and one
injected crash, to measure recovery), and builds one JSON-ready report that the table
(render.simulate_report), ``--json`` and ``--plot`` share.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.table import Table

from cleave.cli import render
from cleave.cli.errors import friendly, stderr_console
from cleave.cli.options import micro_batches_of
from cleave.cli.plan import (
    DEFAULT_LINK_GBPS,
    DEFAULT_RELAY_GB,
    DEFAULT_RELAY_GBPS,
    AsJson,
    BatchSize,
    CoordinatorPreset,
    Coordinators,
    Devices,
    DType,
    DTypeName,
    FleetSpec,
    ModelPreset,
    PsGflops,
    PsLinkGbps,
    PsWorkers,
    RelayLinkGbps,
    RelayMemoryGb,
    Relays,
    SeqLen,
    TierLinkGbps,
    check_options,
    coordinator_ps,
    tier_of,
    with_relays,
    with_workers,
)
from cleave.coordinator.engine.energy import GRID_GCO2_KWH
from cleave.coordinator.engine.live_plan import Planner
from cleave.coordinator.engine.scheduler import FaultPolicy
from cleave.coordinator.planning.costmodel import CostModelError, DeviceClass, PSProfile
from cleave.coordinator.planning.tier import DEFAULT_TIER_GBPS, SOLO, Tier
from cleave.coordinator.whatif.baselines import bytes_per_param, cloud_step, dtfm_step, step_flops
from cleave.coordinator.whatif.energy import (
    COORDINATOR_POWER,
    NETWORK_J_PER_BYTE,
    PUE_DEFAULT,
    STANDBY_W,
    check_pue,
    cleave_energy,
    cloud_energy,
    dtfm_energy,
)
from cleave.coordinator.whatif.presets import model_shape, resolve_fleet
from cleave.coordinator.whatif.runs import run_all
from cleave.coordinator.whatif.simulator import SimConfig, SimResult
from cleave.wire.errors import CleaveError, ConfigError
from cleave.wire.messages import MAX_GRID

MAX_DEVICES = 100_000  # every device is simulated one by one (its links, its leases)
MAX_SWEEP = 16
FAIL_SHARE = 0.5  # the injected crash comes once this share of the last step's GEMMs is submitted
# When no resource is busy this share of the step, round trips and hand-offs set the pace: the
# step is "latency" bound (GEMMs run one after another, each waits for its slowest unit).
LATENCY_BOUND = 0.25
MAX_PUE = 3.0  # far above any surveyed facility's (Uptime's average is 1.58)


def _finite(value: float | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return _finite(num / den) if num is not None and den else None


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


def _breakdown(result: SimResult, step_s: float, ps: PSProfile) -> dict[str, Any]:
    """Where the measured steps' time went (the warm-up step left out, as from ``step_s``)."""
    steps = result.measured
    per = 1.0 / len(steps)

    def mean(attr: str) -> float:
        return sum(getattr(s, attr) for s in steps) * per

    egress, ingress, relayed = mean("egress_bytes"), mean("ingress_bytes"), mean("relay_bytes")
    cpu = {k: sum(s.ps_cpu[k] for s in steps) * per for k in steps[0].ps_cpu}
    busy = {
        "compute": mean("device_compute"),
        "downlink": mean("device_down"),
        "uplink": mean("device_up"),
        "ps_egress": egress / ps.egress,
        "ps_ingress": ingress / ps.ingress,
        "relay_egress": relayed / (ps.relays * ps.relay_egress) if ps.relays else 0.0,  # the relays' mean
        # Its two threads: the verifier's checks, the trainer's attention, assembly and AdamW.
        "ps_cpu": max(cpu.get("verify", 0.0) / ps.workers, sum(v for k, v in cpu.items() if k != "verify")),
        "ps_loop": mean("loop_s") / ps.workers,  # its event loop: framing work, reading results
    }
    # The coordinator's own resources, each's busy share of the step, and the busiest: what binds
    # it (the simulator's ``StepStats.ps_busy``, averaged over the measured steps).
    coordinator = {k: sum(s.ps_busy.get(k, 0.0) for s in steps) * per for k in steps[0].ps_busy}
    bound = max(busy, key=lambda k: busy[k])
    if step_s > 0 and busy[bound] < LATENCY_BOUND * step_s:
        bound = "latency"
    return {
        "busy_s": busy,
        "ps_cpu_s": cpu,
        "bound": bound,
        "utilisation": {k: _ratio(v, step_s) for k, v in busy.items()},
        "coordinator_busy_s": coordinator,
        "coordinator_share": {k: _ratio(v, step_s) for k, v in coordinator.items()},
        "coordinator_busiest": max(coordinator, key=lambda k: coordinator[k]) if coordinator else None,
        "devices_used": round(mean("devices_used")),
        "bytes": {
            "ps_egress": egress,
            "ps_ingress": ingress,
            "relay_out": relayed,
            "device_down_mean": mean("bytes_down_mean"),
            "device_down_max": mean("bytes_down_max"),
            "device_up_mean": mean("bytes_up_mean"),
            "device_up_max": mean("bytes_up_max"),
        },
    }


def simulate_one(
    model_name: str,
    classes: tuple[DeviceClass, ...],
    ps: PSProfile,
    *,
    batch: int,
    seq: int,
    dtype: str,
    seed: int,
    steps: int,
    planner: Planner,
    churn: bool,
    heartbeat_timeout: float,
    baseline_dtype: str | None = None,
    micro_batches: int = 1,
    batched: bool = False,
    tier: Tier = SOLO,
    coordinator: str = "server",
    pue: float = PUE_DEFAULT,
    grid_gco2_kwh: float = GRID_GCO2_KWH,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Simulate one fleet size and price the baselines: the report for one device count. On a
    tier, the simulation is its slowest rank (the batch's slice, its share of the fleet); the
    baselines train the whole batch on the whole fleet. Each of the three carries the step's
    energy (coordinator/whatif/energy.py): ``coordinator`` names the coordinator's power, ``pue``
    the datacentre's, ``grid_gco2_kwh`` the grid's carbon."""
    model = model_shape(model_name)
    devices = sum(c.count for c in classes)
    faults = FaultPolicy(heartbeat_timeout=heartbeat_timeout)
    base = SimConfig(
        model,
        classes,
        ps,
        batch=batch,
        seq=seq,
        dtype=dtype,
        seed=seed,
        steps=steps,
        planner=planner,
        faults=faults,
        churn=False,
        micro_batches=micro_batches,
        batched=batched,
        tier=tier,
    )
    started = time.perf_counter()
    where = f"{devices:,} devices"
    if tier.ranks > 1:
        where = f"one of {tier.ranks} coordinators' share of {where}"
    # Two runs side by side (coordinator/whatif/runs.py): without churn, to price the stalls
    # churn causes, and with churn and one crash on the busiest device, halfway through the
    # last step's GEMMs, to measure recovery. Both choose the same micro-batches (the same fleet
    # at the first step).
    stormy_cfg = dataclasses.replace(base, churn=churn, fail_share=FAIL_SHARE)
    names = ("no churn", "churn, one crash" if churn else "one crash")
    lines = ["starting", "starting"]

    def tell(index: int, line: str) -> None:
        lines[index] = line
        progress(f"simulating {model.name} on {where}: " + "; ".join(f"{n}: {t}" for n, t in zip(names, lines)))

    progress(f"simulating {model.name} on {where} ({names[0]}; {names[1]}) ...")
    calm, stormy = run_all([base, stormy_cfg], tell)
    wall = time.perf_counter() - started
    step_s = stormy.step_s
    stats = stormy.steps[-1]
    report = _breakdown(stormy, step_s, ps)
    report.update(
        {
            "step_s": step_s,
            "steps_s": [s.seconds for s in stormy.steps],
            "calm_step_s": calm.step_s,
            "stall_s": max(0.0, step_s - calm.step_s),
            # The cost model's step: the program list-scheduled with each GEMM's predicted time.
            "predicted_s": stats.forecast,
            "home_s": stats.home,  # every GEMM kept on the coordinator
            "micro_batches": calm.micro_batches,  # the parts each step ran in
            # With --micro-batches auto: the cost model's forecast step for each choice it weighed.
            "micro_batch_forecasts_s": None
            if calm.choice is None
            else {str(m): _finite(s) for m, s in sorted(calm.choice.forecasts.items())},  # the calm run's choice
            "kept_home": stats.kept_home,
            # On a tier: the slowest rank's devices, and its collectives' seconds a step.
            "devices_per_rank": sum(tier.share(c.count) for c in classes),
            "tier_s": statistics.fmean(s.ps_cpu["tier"] for s in stormy.measured),
            "tokens_per_s": _ratio(batch * seq, step_s),
            "flops_per_s": _ratio(step_flops(model, batch, seq), step_s),
            # Per measured step, as every figure of the report.
            **{
                key: statistics.fmean(getattr(s, key) for s in stormy.measured)
                for key in ("units", "copies", "reclaimed", "lost", "leaves", "joins")
            },
            # Each device present: the share of the step it spent computing (idle devices count).
            "fleet_utilisation": statistics.fmean(s.fleet_utilisation for s in stormy.measured),
            "utilisation_quantiles": {f"p{round(q * 100)}": v for q, v in stats.utilisation_quantiles.items()},
            "class_utilisation": stats.class_utilisation,
            # The most the devices' links allow them to compute, whatever the plan (an upper bound).
            "utilisation_ceiling": statistics.fmean(s.utilisation_ceiling for s in stormy.measured),
            # ...and the most the step's GEMM FLOP could keep them busy in its time, within that.
            "utilisation_bound": statistics.fmean(s.utilisation_bound for s in stormy.measured),
            # ...and with only the work that can wait (dW) on them: the critical path left fast.
            "utilisation_wait_bound": statistics.fmean(s.utilisation_wait_bound for s in stormy.measured),
            "gemms_in_flight": {
                "mean": statistics.fmean(s.gemms_in_flight for s in stormy.measured),
                "max": max(s.most_gemms_in_flight for s in stormy.measured),
            },
            "local_gemms": stats.local_gemms,
            "remote_gemms": stats.remote_gemms,
            "partitions": dict(sorted(stormy.kinds.items())),
            # The injected crash's: until every unit it had not delivered was verified elsewhere.
            "recovery_s": stormy.injected_recovery,
            "churn_recoveries_s": sorted(stormy.recoveries),
            "events": calm.events + stormy.events,
            "wall_s": wall,
        }
    )
    # The baselines train in the job's dtype (bf16 on the wire is Cleave's lever, not theirs).
    dtfm = dtfm_step(model, classes, batch, seq, baseline_dtype or dtype)
    cloud = cloud_step(model, batch, seq, baseline_dtype or dtype)
    dtfm_json: dict[str, Any] = {
        "step_s": _finite(dtfm.step_s),
        "why": dtfm.why,
        "stages": dtfm.stages,
        "head_stage": dtfm.head_stage,  # the lm head in a stage of its own
        "embed_stage": dtfm.embed_stage,  # the embedding in a stage of its own
        "replicas": dtfm.replicas,
        "devices_used": dtfm.devices_used,
        "bound": dtfm.bound,
        "compute_s": dtfm.compute_s,
        "pipeline_comm_s": dtfm.pipeline_comm_s,
        "allreduce_s": dtfm.allreduce_s,
        "bubble_s": dtfm.bubble_s,
        "memory_per_device": dtfm.memory_per_device,
        "recovery_s": None,
    }
    if dtfm.step_s is not None and dtfm.stages:
        # DTFM has no per-tile recovery: a lost stage device stalls its pipeline until it is seen
        # (the same heartbeat timeout), a replacement downloads its stage's training state (weights,
        # gradients, Adam: bytes_per_param per parameter) over the fastest downlink in the fleet,
        # and the step runs again (on average half of it was lost). Every choice favours DTFM.
        fastest_down = max(c.profile.down for c in classes if c.count)
        state = bytes_per_param(baseline_dtype or dtype) * model.params / dtfm.stages
        dtfm_json["recovery_s"] = heartbeat_timeout + state / fastest_down + dtfm.step_s / 2
    # Energy: the simulated rank's devices stand for the whole fleet's (``scale`` such shares).
    flops = step_flops(model, batch, seq)
    per_rank = report["devices_per_rank"]
    scale = devices / per_rank if per_rank else 1.0
    measured = stormy.measured
    busy: dict[str, float] = {}
    present: dict[str, float] = {}
    asleep: dict[str, float] = {}
    for s in measured:
        for name, v in s.class_standby_s.items():
            asleep[name] = asleep.get(name, 0.0) + v / len(measured)
        for name, v in s.class_busy_s.items():
            busy[name] = busy.get(name, 0.0) + v / len(measured)
        for name, v in s.class_present_s.items():
            present[name] = present.get(name, 0.0) + v / len(measured)
    moved = sum(s.egress_bytes + s.ingress_bytes + s.relay_bytes for s in measured) / len(measured)
    cleave_e = cleave_energy(
        classes,
        busy,
        present,
        step_s,
        coordinator_w=COORDINATOR_POWER[coordinator],
        coordinators=tier.ranks,
        relays=ps.relays,
        pue=pue,
        flops=flops,
        network_bytes=moved * tier.ranks,
        scale=scale,
        grid_gco2_kwh=grid_gco2_kwh,
        standby_s=asleep,
    )
    report["energy"] = cleave_e.as_json()
    dtfm_e = dtfm_energy(dtfm, classes, baseline_dtype or dtype, flops=flops, grid_gco2_kwh=grid_gco2_kwh)
    dtfm_json["energy"] = None if dtfm_e is None else dtfm_e.as_json()
    cloud_e = cloud_energy(cloud, pue=pue, grid_gco2_kwh=grid_gco2_kwh)
    cloud_json = {
        "energy": cloud_e.as_json(),
        "step_s": cloud.step_s,
        "gpus": cloud.gpus,
        "gpu": cloud.gpu,
        "utilisation": cloud.utilisation,
        "peak_tflops": cloud.peak_tflops,
        "fits": cloud.fits,
        "source": cloud.source,
    }
    return {
        "devices": devices,
        "fleet": [
            {
                "name": c.name,
                "count": c.count,
                "gflops": c.profile.gflops.get(dtype, 0.0),
                "down": c.profile.down,
                "up": c.profile.up,
                "rtt": c.profile.rtt,
                "memory": c.profile.memory,
                "session": _finite(c.profile.session),
            }
            for c in classes
        ],
        "cleave": report,
        "dtfm": dtfm_json,
        "cloud": cloud_json,
        "speedup": {
            "vs_dtfm": _ratio(dtfm_json["step_s"], step_s),
            "vs_cloud": _ratio(cloud.step_s, step_s),
            "recovery_vs_dtfm": _ratio(dtfm_json["recovery_s"], report["recovery_s"]),
        },
        # The baseline's energy a step over Cleave's: above 1, Cleave uses less. Whole draw, and
        # the increment over machines on anyway (coordinator/whatif/energy.py).
        "energy_ratio": {
            "vs_dtfm": None if dtfm_e is None else _ratio(dtfm_e.energy_j, cleave_e.energy_j),
            "vs_cloud": _ratio(cloud_e.energy_j, cleave_e.energy_j),
            "increment_vs_dtfm": None if dtfm_e is None else _ratio(dtfm_e.increment_j, cleave_e.increment_j),
            "increment_vs_cloud": _ratio(cloud_e.increment_j, cleave_e.increment_j),
        },
    }


def parse_sweep(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--sweep takes device counts separated by commas, got {text!r}") from None
    if not counts or len(counts) > MAX_SWEEP or any(not 1 <= c <= MAX_DEVICES for c in counts):
        raise ConfigError(f"--sweep takes 1 to {MAX_SWEEP} counts, each from 1 to {MAX_DEVICES:,}")
    return counts


def build_report(
    *,
    model: str,
    fleet: str,
    devices: list[int | None],
    ps: PSProfile,
    link_gbps: float,
    batch: int,
    seq: int,
    dtype: str,
    seed: int,
    steps: int,
    planner: Planner,
    churn: bool,
    down_up_ratio: float | None,
    wire_half: bool,
    heartbeat_timeout: float,
    micro_batches: int = 1,
    batched: bool = False,
    tier: Tier = SOLO,
    coordinator: str = "server",
    pue: float = PUE_DEFAULT,
    grid_gco2_kwh: float = GRID_GCO2_KWH,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    shape = model_shape(model)
    if seq > shape.max_seq_len:
        raise ConfigError(f"--seq-len {seq} exceeds {shape.name}'s {shape.max_seq_len} positions")
    wire = "bf16" if wire_half else dtype
    runs = []
    for count in devices:
        classes = resolve_fleet(fleet, dtype, count)
        if sum(c.count for c in classes) > MAX_DEVICES:
            raise ConfigError(
                f"the fleet has {sum(c.count for c in classes):,} devices; cleave simulate runs at most {MAX_DEVICES:,}"
            )
        classes = adjust_fleet(classes, down_up_ratio=down_up_ratio, wire_half=wire_half, dtype=wire)
        runs.append(
            simulate_one(
                model,
                classes,
                ps,
                batch=batch,
                seq=seq,
                dtype=wire,
                seed=seed,
                steps=steps,
                planner=planner,
                churn=churn,
                heartbeat_timeout=heartbeat_timeout,
                baseline_dtype=dtype,
                micro_batches=micro_batches,
                batched=batched,
                tier=tier,
                coordinator=coordinator,
                pue=pue,
                grid_gco2_kwh=grid_gco2_kwh,
                progress=progress,
            )
        )
    head = {
        "model": {"name": shape.name, "params": shape.params, "layers": shape.n_layers, "d_model": shape.d_model},
        "fleet_spec": fleet,
        "batch_size": batch,
        "seq_len": seq,
        "tokens": batch * seq,
        "dtype": dtype,
        "wire_dtype": wire,
        "seed": seed,
        "steps": steps,
        "planner": planner.value,
        "micro_batches": micro_batches or "auto",  # each run says what it ran (auto: the cost model chose)
        "batched": batched,
        "churn": churn,
        "down_up_ratio": down_up_ratio,
        "coordinators": tier.ranks,
        "tier_link_gbps": tier.link * 8 / 1e9,
        "ps": {
            "preset": coordinator,
            "link_gbps": link_gbps,
            "egress": ps.egress,
            "ingress": ps.ingress,
            "gflops": ps.gflops.get(wire),
            "verify_gflops": ps.verify_flops / 1e9,
            "memory_bw": ps.memory_bw,
            "unit_overhead": ps.unit_overhead,
            "check_columns": ps.check_columns,
            "workers": ps.workers,
            "relays": ps.relays,
            "relay_link_gbps": ps.relay_egress * 8 / 1e9,
            "relay_memory_gb": ps.relay_memory / 1e9,
        },
        # What the energy figures assume (coordinator/whatif/energy.py; docs/simulation.md "Energy").
        "energy_assumptions": {
            "grid_gco2_kwh": grid_gco2_kwh,
            "pue": pue,
            "coordinator_w": COORDINATOR_POWER[coordinator],
            "network_j_per_gb": NETWORK_J_PER_BYTE * 1e9,
            "standby_w": STANDBY_W,
        },
    }
    if len(runs) == 1:
        return {**head, **runs[0]}
    return {
        **head,
        "sweep": runs,
        "cleave": {
            "step_s": [r["cleave"]["step_s"] for r in runs],
            "energy_j": [r["cleave"]["energy"]["energy_j"] for r in runs],
            "increment_j": [r["cleave"]["energy"]["increment_j"] for r in runs],
        },
        "dtfm": {
            "step_s": [r["dtfm"]["step_s"] for r in runs],
            "energy_j": [r["dtfm"]["energy"] and r["dtfm"]["energy"]["energy_j"] for r in runs],
            "increment_j": [r["dtfm"]["energy"] and r["dtfm"]["energy"]["increment_j"] for r in runs],
        },
        "cloud": {
            "step_s": [r["cloud"]["step_s"] for r in runs],
            "energy_j": [r["cloud"]["energy"]["energy_j"] for r in runs],
            "increment_j": [r["cloud"]["energy"]["increment_j"] for r in runs],
        },
    }


def plot(report: dict[str, Any], path: str) -> None:
    """Per-batch time against device count for Cleave and the baselines (matplotlib, an extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'cleave[plot]'") from None
    runs = report.get("sweep") or [report]
    xs = [r["devices"] for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.plot(xs, [r["cleave"]["step_s"] for r in runs], "o-", label="Cleave (simulated)")
    dtfm = [(x, r["dtfm"]["step_s"]) for x, r in zip(xs, runs) if r["dtfm"]["step_s"] is not None]
    if dtfm:
        ax.plot(*zip(*dtfm), "s--", label="DTFM-style pipeline + data parallel")
    cloud = runs[0]["cloud"]
    ax.axhline(
        cloud["step_s"],
        color="grey",
        linestyle=":",
        label=f"cloud: {cloud['gpus']}x {cloud['gpu']} at {cloud['utilisation']:.0%} MFU",
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("devices")
    ax.set_ylabel("seconds per batch")
    ax.set_title(
        f"{report['model']['name']} on {report['fleet_spec']}, batch {report['batch_size']} x "
        f"{report['seq_len']}, PS link {report['ps']['link_gbps']:g} Gbit/s"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:
        raise CleaveError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


def _joules(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("MJ", 1e6), ("kJ", 1e3)):
        if value >= size:
            return f"{value / size:,.3g} {unit}"
    return f"{value:.3g} J"


def energy_table(report: dict[str, Any]) -> Table:
    """The energy of a step for Cleave and both baselines, one row each (per device count in a
    sweep). Built, never printed (the command prints it after the time report)."""
    a = report["energy_assumptions"]
    table = Table(
        title=f"energy per step (grid {a['grid_gco2_kwh']:g} gCO2e/kWh, datacentre PUE {a['pue']:g}; "
        "increment: over machines on anyway; "
        'network apart: docs/simulation.md "Energy")',
        title_justify="left",
    )
    columns = ("devices", "system", "J/step", "increment", "busy", "waiting", "datacentre", "J/GFLOP", "gCO2e")
    columns += ("network",)
    for name in columns:
        table.add_column(name, justify="right")
    for run in report.get("sweep") or [report]:
        for system, part in (("Cleave", run["cleave"]), ("DTFM-style", run["dtfm"]), ("cloud", run["cloud"])):
            e = part.get("energy")
            if e is None:
                table.add_row(f"{run['devices']:,}", system, "does not fit", *["-"] * (len(columns) - 3))
                continue
            per = e["energy_j_per_gflop"]
            table.add_row(
                f"{run['devices']:,}",
                system,
                _joules(e["energy_j"]),
                _joules(e["increment_j"]),
                _joules(e["devices_busy_j"]),
                _joules(e["devices_waiting_j"]),
                _joules(e["datacentre_j"]),
                "-" if per is None else f"{per:.3g}",
                f"{e['co2_g']:,.3g}",
                _joules(e["network_j"]),
            )
    return table


@friendly
def simulate(
    model: ModelPreset = "small",
    fleet: FleetSpec = "laptops",
    devices: Devices = None,
    sweep: Annotated[
        str | None,
        typer.Option("--sweep", help="Several device counts, e.g. 16,64,256,1024,4096 (overrides --devices)."),
    ] = None,
    ps_link_gbps: PsLinkGbps = DEFAULT_LINK_GBPS,
    ps_gflops: PsGflops = None,
    ps_workers: PsWorkers = 1,
    coordinator: CoordinatorPreset = "server",
    coordinators: Coordinators = 1,
    tier_link_gbps: TierLinkGbps = DEFAULT_TIER_GBPS,
    relays: Relays = 0,
    relay_link_gbps: RelayLinkGbps = DEFAULT_RELAY_GBPS,
    relay_memory_gb: RelayMemoryGb = DEFAULT_RELAY_GB,
    batch_size: BatchSize = 8,
    seq_len: SeqLen = 256,
    dtype: DTypeName = DType.FP32.value,
    seed: Annotated[int, typer.Option("--seed", help="Seeds sessions, crashes and rejoins.")] = 0,
    steps: Annotated[int, typer.Option("--steps", help="Steps to simulate (more than one: the first is warm-up).")] = 1,
    planner: Annotated[
        Planner, typer.Option("--planner", help="cost: the cost model's plan per GEMM; uniform: the fixed grid.")
    ] = Planner.COST,
    churn: Annotated[
        bool, typer.Option("--churn/--no-churn", help="Devices leave (sessions from the fleet) and are replaced.")
    ] = True,
    down_up_ratio: Annotated[
        float | None, typer.Option("--down-up-ratio", help="Set every device's uplink to its downlink over this ratio.")
    ] = None,
    wire_half: Annotated[
        bool, typer.Option("--wire-half", help="Blocks and results travel in bf16; devices compute at their fp32 rate.")
    ] = False,
    heartbeat_timeout: Annotated[
        float, typer.Option("--heartbeat-timeout", help="Seconds of silence before a crashed device is noticed.")
    ] = FaultPolicy().heartbeat_timeout,
    micro_batches: Annotated[
        str,
        typer.Option(
            "--micro-batches",
            help="The batch in this many parts through the model side by side, the fleet in as many lanes "
            "(1: one GEMM after another, each waited for; auto: the cost model forecasts the step for each "
            "choice up to 8 on the fleet and takes the best).",
        ),
    ] = "auto",
    batched: Annotated[
        bool,
        typer.Option(
            "--batched/--no-batched", help="A device's tiles of a GEMM go out in a few batched work messages."
        ),
    ] = False,
    plot_path: Annotated[
        str | None, typer.Option("--plot", help="Draw seconds per batch against devices to this PNG.")
    ] = None,
    pue: Annotated[
        float,
        typer.Option(
            "--pue",
            help="Power usage effectiveness of the datacentres (the coordinator's and the cloud's); "
            f"default {PUE_DEFAULT:g}, a hyperscaler's (1.58: the industry average).",
        ),
    ] = PUE_DEFAULT,
    grid_gco2_kwh: Annotated[
        float,
        typer.Option(
            "--grid-gco2-kwh",
            help=f"Grams of CO2e per kWh of the grid; default {GRID_GCO2_KWH:g}, the world's average "
            "(Ember, Global Electricity Review 2023).",
        ),
    ] = GRID_GCO2_KWH,
    as_json: AsJson = False,
) -> None:
    """Simulate training steps of a model on a fleet with the live scheduler on a virtual clock,
    against a DTFM-style edge baseline and a cloud baseline."""
    check_options(dtype, devices, batch_size, seq_len, ps_link_gbps, MAX_DEVICES)
    if wire_half and dtype != DType.FP32.value:
        raise ConfigError(f"--wire-half is for fp32 training (blocks already travel in 2 bytes with --dtype {dtype})")
    counts: list[int | None] = parse_sweep(sweep) if sweep is not None else [devices]
    if not 1 <= steps <= 100:
        raise ConfigError(f"--steps must be between 1 and 100, got {steps}")
    parts = micro_batches_of(micro_batches)  # 0: auto
    tier = tier_of(coordinators, tier_link_gbps, batch_size)
    per_rank = batch_size // coordinators
    if parts and (parts > per_rank or per_rank % parts):
        what = "--batch-size" if coordinators == 1 else "each coordinator's slice of --batch-size"
        raise ConfigError(f"--micro-batches must divide {what} ({per_rank}), got {parts}")
    if down_up_ratio is not None and not (math.isfinite(down_up_ratio) and 0 < down_up_ratio <= 1000):
        raise ConfigError(f"--down-up-ratio must be above 0 and at most 1000, got {down_up_ratio}")
    if not (math.isfinite(heartbeat_timeout) and FaultPolicy().heartbeat < heartbeat_timeout <= 3600):
        raise ConfigError(
            f"--heartbeat-timeout must be above {FaultPolicy().heartbeat:g} s and at most 3600, got {heartbeat_timeout}"
        )
    if not (math.isfinite(pue) and 1 <= pue <= MAX_PUE):
        raise ConfigError(f"--pue must be between 1 and {MAX_PUE:g}, got {pue}")
    if not (math.isfinite(grid_gco2_kwh) and 0 <= grid_gco2_kwh <= MAX_GRID):
        raise ConfigError(f"--grid-gco2-kwh must be between 0 and {MAX_GRID:g}, got {grid_gco2_kwh}")
    check_pue(pue)
    ps = with_relays(coordinator_ps(coordinator, ps_link_gbps, ps_gflops), relays, relay_link_gbps, relay_memory_gb)
    ps = with_workers(ps, ps_workers)
    with stderr_console().status("simulating ...") as status:
        try:
            report = build_report(
                model=model,
                fleet=fleet,
                devices=counts,
                ps=ps,
                link_gbps=ps_link_gbps,
                batch=batch_size,
                seq=seq_len,
                dtype=dtype,
                seed=seed,
                steps=steps,
                planner=planner,
                churn=churn,
                down_up_ratio=down_up_ratio,
                wire_half=wire_half,
                heartbeat_timeout=heartbeat_timeout,
                micro_batches=parts,
                batched=batched,
                tier=tier,
                coordinator=coordinator,
                pue=pue,
                grid_gco2_kwh=grid_gco2_kwh,
                progress=status.update,
            )
        except CostModelError as exc:
            raise ConfigError(str(exc)) from None
    if plot_path is not None:
        plot(report, plot_path)
    if as_json:
        Console(highlight=False).out(json.dumps(report, sort_keys=True, allow_nan=False))
        return
    Console(highlight=False).print(Group(render.simulate_report(report), energy_table(report)))
