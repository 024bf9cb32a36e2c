"""``cleave simulate``: what a fleet would do with a model, before anyone is recruited.

The simulation itself is coordinator/whatif/simulator.py (the live scheduler and planner on a
virtual clock); what runs at each device count (a calm run, to price the stalls churn causes, and
one with churn and one injected crash, to measure recovery, beside both baselines) is
coordinator/whatif/experiments.py, and the one JSON-ready report that the table
(render.simulate_report), ``--json`` and ``--plot`` share is coordinator/whatif/report.py's.
This module parses the options and prints.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.table import Table

from cleave.cli import render
from cleave.cli.errors import friendly, stderr_console
from cleave.cli.options import AsJson, check_heartbeat_timeout, micro_batches_of, print_json
from cleave.cli.plan import priced
from cleave.coordinator.engine.energy import GRID_GCO2_KWH
from cleave.coordinator.engine.live_plan import Planner
from cleave.coordinator.engine.scheduler import FaultPolicy
from cleave.coordinator.planning.costmodel import CostModelError
from cleave.coordinator.whatif.energy import PUE_DEFAULT, check_pue
from cleave.coordinator.whatif.experiments import (
    DEFAULT_RELAY_GB,
    DEFAULT_RELAY_GBPS,
    SIMULATE_MAX_DEVICES,
    DType,
    Settings,
    Setup,
    simulate_counts,
    with_relays,
)
from cleave.coordinator.whatif.report import simulate_report
from cleave.wire.errors import CleaveError, ConfigError
from cleave.wire.messages import MAX_GRID

MAX_SWEEP = 16
MAX_PUE = 3.0  # far above any surveyed facility's (Uptime's average is 1.58)

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


def parse_sweep(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--sweep takes device counts separated by commas, got {text!r}") from None
    if not counts or len(counts) > MAX_SWEEP or any(not 1 <= c <= SIMULATE_MAX_DEVICES for c in counts):
        raise ConfigError(f"--sweep takes 1 to {MAX_SWEEP} counts, each from 1 to {SIMULATE_MAX_DEVICES:,}")
    return counts


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
@priced(SIMULATE_MAX_DEVICES)
def simulate(
    setup: Setup,
    sweep: Annotated[
        str | None,
        typer.Option("--sweep", help="Several device counts, e.g. 16,64,256,1024,4096 (overrides --devices)."),
    ] = None,
    relays: Relays = 0,
    relay_link_gbps: RelayLinkGbps = DEFAULT_RELAY_GBPS,
    relay_memory_gb: RelayMemoryGb = DEFAULT_RELAY_GB,
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
    if wire_half and setup.dtype != DType.FP32.value:
        raise ConfigError(
            f"--wire-half is for fp32 training (blocks already travel in 2 bytes with --dtype {setup.dtype})"
        )
    counts: list[int | None] = parse_sweep(sweep) if sweep is not None else [setup.devices]
    if not 1 <= steps <= 100:
        raise ConfigError(f"--steps must be between 1 and 100, got {steps}")
    parts = micro_batches_of(micro_batches)  # 0: auto
    per_rank = setup.tier.slice(setup.batch)
    if parts and (parts > per_rank or per_rank % parts):
        what = "--batch-size" if setup.tier.ranks == 1 else "each coordinator's slice of --batch-size"
        raise ConfigError(f"--micro-batches must divide {what} ({per_rank}), got {parts}")
    if down_up_ratio is not None and not (math.isfinite(down_up_ratio) and 0 < down_up_ratio <= 1000):
        raise ConfigError(f"--down-up-ratio must be above 0 and at most 1000, got {down_up_ratio}")
    check_heartbeat_timeout(heartbeat_timeout)
    if not (math.isfinite(pue) and 1 <= pue <= MAX_PUE):
        raise ConfigError(f"--pue must be between 1 and {MAX_PUE:g}, got {pue}")
    if not (math.isfinite(grid_gco2_kwh) and 0 <= grid_gco2_kwh <= MAX_GRID):
        raise ConfigError(f"--grid-gco2-kwh must be between 0 and {MAX_GRID:g}, got {grid_gco2_kwh}")
    check_pue(pue)
    settings = Settings(
        dataclasses.replace(setup, ps=with_relays(setup.ps, relays, relay_link_gbps, relay_memory_gb)),
        seed=seed,
        steps=steps,
        planner=planner,
        churn=churn,
        heartbeat_timeout=heartbeat_timeout,
        wire_half=wire_half,
        down_up_ratio=down_up_ratio,
        micro_batches=parts,
        batched=batched,
        pue=pue,
        grid_gco2_kwh=grid_gco2_kwh,
    )
    with stderr_console().status("simulating ...") as status:
        try:
            report = simulate_report(settings, simulate_counts(counts, settings, status.update))
        except CostModelError as exc:
            raise ConfigError(str(exc)) from None
    if plot_path is not None:
        plot(report, plot_path)
    if as_json:
        print_json(report, allow_nan=False)
        return
    Console(highlight=False).print(Group(render.simulate_report(report), energy_table(report)))
