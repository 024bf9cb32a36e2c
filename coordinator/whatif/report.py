"""The ``--json`` documents of ``cleave plan`` and ``cleave simulate``, built from what
experiments.py ran: the one object each prints with stable keys (docs/cli.md names every key),
and what the commands' tables (cleave_cli/render.py), ``--plot`` and bench/ read.

JSON has no Infinity or NaN: an impossible time, or a ratio over nothing, is null.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from cleave.coordinator.planning.costmodel import DeviceClass, PSProfile
from cleave.coordinator.planning.planner import Kind, Plan
from cleave.coordinator.whatif.baselines import step_flops
from cleave.coordinator.whatif.energy import COORDINATOR_POWER, NETWORK_J_PER_BYTE, STANDBY_W
from cleave.coordinator.whatif.experiments import FleetRun, PlanRun, Settings, Setup
from cleave.coordinator.whatif.presets import ModelShape
from cleave.coordinator.whatif.simulator import SimResult

# When no resource is busy this share of the step, round trips and hand-offs set the pace: the
# step is "latency" bound (GEMMs run one after another, each waits for its slowest unit).
LATENCY_BOUND = 0.25


def _finite(value: float | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return _finite(num / den) if num is not None and den else None


def _model_json(model: ModelShape) -> dict[str, Any]:
    return {"name": model.name, "params": model.params, "layers": model.n_layers, "d_model": model.d_model}


def _ps_json(setup: Setup, dtype: str | None = None) -> dict[str, Any]:
    """The coordinator a report priced, its GEMM rate in ``dtype`` (default: the setup's)."""
    ps = setup.ps
    return {
        "preset": setup.coordinator,
        "link_gbps": setup.link_gbps,
        "egress": ps.egress,
        "ingress": ps.ingress,
        "gflops": ps.gflops.get(dtype or setup.dtype),
        "verify_gflops": ps.verify_flops / 1e9,
        "memory_bw": ps.memory_bw,
        "unit_overhead": ps.unit_overhead,
        "check_columns": ps.check_columns,
        "workers": ps.workers,
    }


# --------------------------------------------------------------------------- cleave plan


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


def plan_report(run: PlanRun) -> dict[str, Any]:
    """``cleave plan --json``: the step, each GEMM's plan beside its round-robin baseline, and
    the fleet's classes with the memory the plans ask of them."""
    u, step, bases, fleet = run.setup, run.step, run.baselines, run.fleet
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
    tokens = u.batch * u.seq
    return {
        "model": _model_json(run.model),
        "fleet": {
            "spec": u.fleet,
            "devices": run.devices,
            "gflops": step.fleet_flops / 1e9,
            "classes": [_class_json(cls, u.dtype) for cls in fleet],
        },
        "coordinators": u.tier.ranks,
        "tier": {
            "link_gbps": u.tier.link * 8 / 1e9,
            "devices_per_rank": sum(cls.count for cls in fleet),
            "batch_per_rank": u.tier.slice(u.batch),
            "seconds": run.collectives_s,  # the gradients' reduce-scatter and the weights' all-gather, per step
        },
        "ps": _ps_json(u),
        "batch_size": u.batch,
        "seq_len": u.seq,
        "tokens": tokens,
        "dtype": u.dtype,
        "step": {
            "seconds": step.seconds,
            "tokens_per_s": tokens / step.seconds,
            "gemm_seconds": step.gemm_seconds,
            "ps_other_seconds": step.ps_other_seconds,
            "attention_seconds": run.attention_s,
            "optimizer_seconds": run.optimizer_s,
            "tier_seconds": run.collectives_s,
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


# --------------------------------------------------------------------------- cleave simulate


def breakdown(result: SimResult, step_s: float, ps: PSProfile) -> dict[str, Any]:
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


def _cleave_json(run: FleetRun) -> dict[str, Any]:
    """Cleave's simulated step: the run with churn and one crash, its calm twin's step beside it."""
    u, calm, stormy = run.settings.setup, run.calm, run.stormy
    step_s = stormy.step_s
    stats = stormy.steps[-1]
    measured = stormy.measured
    out = breakdown(stormy, step_s, u.ps)
    out.update(
        {
            "step_s": step_s,
            "steps_s": [m.seconds for m in stormy.steps],
            "calm_step_s": calm.step_s,
            "stall_s": max(0.0, step_s - calm.step_s),
            # The cost model's step: the program list-scheduled with each GEMM's predicted time.
            "predicted_s": stats.forecast,
            "home_s": stats.home,  # every GEMM kept on the coordinator
            "micro_batches": calm.micro_batches,  # the parts each step ran in
            # With --micro-batches auto: the cost model's forecast step for each choice it weighed.
            "micro_batch_forecasts_s": None
            if calm.choice is None
            else {str(m): _finite(f) for m, f in sorted(calm.choice.forecasts.items())},  # the calm run's choice
            "kept_home": stats.kept_home,
            # On a tier: the slowest rank's devices, and its collectives' seconds a step.
            "devices_per_rank": run.devices_per_rank,
            "tier_s": statistics.fmean(m.ps_cpu["tier"] for m in measured),
            "tokens_per_s": _ratio(u.batch * u.seq, step_s),
            "flops_per_s": _ratio(step_flops(run.model, u.batch, u.seq), step_s),
            # Per measured step, as every figure of the report.
            **{
                key: statistics.fmean(getattr(m, key) for m in measured)
                for key in ("units", "copies", "reclaimed", "lost", "leaves", "joins")
            },
            # Each device present: the share of the step it spent computing (idle devices count).
            "fleet_utilisation": statistics.fmean(m.fleet_utilisation for m in measured),
            "utilisation_quantiles": {f"p{round(q * 100)}": v for q, v in stats.utilisation_quantiles.items()},
            "class_utilisation": stats.class_utilisation,
            # The most the devices' links allow them to compute, whatever the plan (an upper bound).
            "utilisation_ceiling": statistics.fmean(m.utilisation_ceiling for m in measured),
            # ...and the most the step's GEMM FLOP could keep them busy in its time, within that.
            "utilisation_bound": statistics.fmean(m.utilisation_bound for m in measured),
            # ...and with only the work that can wait (dW) on them: the critical path left fast.
            "utilisation_wait_bound": statistics.fmean(m.utilisation_wait_bound for m in measured),
            "gemms_in_flight": {
                "mean": statistics.fmean(m.gemms_in_flight for m in measured),
                "max": max(m.most_gemms_in_flight for m in measured),
            },
            "local_gemms": stats.local_gemms,
            "remote_gemms": stats.remote_gemms,
            "partitions": dict(sorted(stormy.kinds.items())),
            # The injected crash's: until every unit it had not delivered was verified elsewhere.
            "recovery_s": stormy.injected_recovery,
            "churn_recoveries_s": sorted(stormy.recoveries),
            "events": calm.events + stormy.events,
            "wall_s": run.wall_s,
            "energy": run.energy.as_json(),
        }
    )
    return out


def _dtfm_json(run: FleetRun) -> dict[str, Any]:
    dtfm = run.dtfm
    return {
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
        "recovery_s": run.dtfm_recovery_s,
        "energy": None if run.dtfm_energy is None else run.dtfm_energy.as_json(),
    }


def run_report(run: FleetRun) -> dict[str, Any]:
    """One device count's report: the fleet, Cleave's step (``cleave``), both baselines', and
    the ratios between them."""
    cleave, dtfm, cloud = _cleave_json(run), _dtfm_json(run), run.cloud
    step_s = cleave["step_s"]
    energy, dtfm_e, cloud_e = run.energy, run.dtfm_energy, run.cloud_energy
    return {
        "devices": run.devices,
        "fleet": [
            {
                "name": c.name,
                "count": c.count,
                "gflops": c.profile.gflops.get(run.settings.wire, 0.0),
                "down": c.profile.down,
                "up": c.profile.up,
                "rtt": c.profile.rtt,
                "memory": c.profile.memory,
                "session": _finite(c.profile.session),
            }
            for c in run.classes
        ],
        "cleave": cleave,
        "dtfm": dtfm,
        "cloud": {
            "energy": cloud_e.as_json(),
            "step_s": cloud.step_s,
            "gpus": cloud.gpus,
            "gpu": cloud.gpu,
            "utilisation": cloud.utilisation,
            "peak_tflops": cloud.peak_tflops,
            "fits": cloud.fits,
            "source": cloud.source,
        },
        "speedup": {
            "vs_dtfm": _ratio(dtfm["step_s"], step_s),
            "vs_cloud": _ratio(cloud.step_s, step_s),
            "recovery_vs_dtfm": _ratio(dtfm["recovery_s"], cleave["recovery_s"]),
        },
        # The baseline's energy a step over Cleave's: above 1, Cleave uses less. Whole draw, and
        # the increment over machines on anyway (coordinator/whatif/energy.py).
        "energy_ratio": {
            "vs_dtfm": None if dtfm_e is None else _ratio(dtfm_e.energy_j, energy.energy_j),
            "vs_cloud": _ratio(cloud_e.energy_j, energy.energy_j),
            "increment_vs_dtfm": None if dtfm_e is None else _ratio(dtfm_e.increment_j, energy.increment_j),
            "increment_vs_cloud": _ratio(cloud_e.increment_j, energy.increment_j),
        },
    }


def _sweep_series(runs: Sequence[dict[str, Any]], system: str) -> dict[str, list[Any]]:
    """One system's step and energy at each device count of a sweep (null where it cannot run)."""
    parts = [r[system] for r in runs]
    return {
        "step_s": [p["step_s"] for p in parts],
        "energy_j": [p["energy"] and p["energy"]["energy_j"] for p in parts],
        "increment_j": [p["energy"] and p["energy"]["increment_j"] for p in parts],
    }


def simulate_report(settings: Settings, runs: Sequence[FleetRun]) -> dict[str, Any]:
    """``cleave simulate --json``: what was simulated, then one count's report, or a sweep's
    reports with each system's figures side by side."""
    s, u = settings, settings.setup
    head = {
        "model": _model_json(runs[0].model),
        "fleet_spec": u.fleet,
        "batch_size": u.batch,
        "seq_len": u.seq,
        "tokens": u.batch * u.seq,
        "dtype": u.dtype,
        "wire_dtype": s.wire,
        "seed": s.seed,
        "steps": s.steps,
        "planner": s.planner.value,
        "micro_batches": s.micro_batches or "auto",  # each run says what it ran (auto: the cost model chose)
        "batched": s.batched,
        "churn": s.churn,
        "down_up_ratio": s.down_up_ratio,
        "coordinators": u.tier.ranks,
        "tier_link_gbps": u.tier.link * 8 / 1e9,
        "ps": {
            **_ps_json(u, s.wire),
            "relays": u.ps.relays,
            "relay_link_gbps": u.ps.relay_egress * 8 / 1e9,
            "relay_memory_gb": u.ps.relay_memory / 1e9,
        },
        # What the energy figures assume (coordinator/whatif/energy.py; docs/simulation.md "Energy").
        "energy_assumptions": {
            "grid_gco2_kwh": s.grid_gco2_kwh,
            "pue": s.pue,
            "coordinator_w": COORDINATOR_POWER[u.coordinator],
            "network_j_per_gb": NETWORK_J_PER_BYTE * 1e9,
            "standby_w": STANDBY_W,
        },
    }
    reports = [run_report(r) for r in runs]
    if len(reports) == 1:
        return {**head, **reports[0]}
    return {
        **head,
        "sweep": reports,
        **{system: _sweep_series(reports, system) for system in ("cleave", "dtfm", "cloud")},
    }
