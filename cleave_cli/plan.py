"""``cleave plan``: how the cost model would cut every GEMM of one training step over a fleet.

The options ``cleave plan`` and ``cleave simulate`` share are declared and checked here once
(``priced``). What runs is coordinator/whatif/experiments.py (the planner's step beside the
round-robin baseline) and the ``--json`` object is coordinator/whatif/report.py's; this module
parses the options and prints that object, or the table render.plan_report makes of it.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from cleave.cli import options as opt
from cleave.cli import render
from cleave.cli.errors import friendly, is_terminal, stderr_console
from cleave.coordinator.planning.tier import DEFAULT_TIER_GBPS, MAX_RANKS, Tier
from cleave.coordinator.whatif.experiments import (
    DEFAULT_LINK_GBPS,
    MAX_BATCH,
    PLAN_MAX_DEVICES,
    DType,
    Setup,
    coordinator_ps,
    plan_fleet,
    with_workers,
)
from cleave.coordinator.whatif.presets import COORDINATORS, FLEETS, MODELS
from cleave.coordinator.whatif.report import plan_report
from cleave.wire.errors import ConfigError

F = TypeVar("F", bound=Callable[..., Any])

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
PsGflops = Annotated[
    float | None,
    typer.Option("--ps-gflops", help="The parameter server's own GEMM rate (GFLOP/s). Default: the --coordinator's."),
]
PsWorkers = Annotated[
    int,
    typer.Option(
        "--ps-workers",
        help="What-if: event loops and verifiers sharing the coordinator's work (PSProfile.workers; "
        "the coordinator runs 1 of each, with send threads beside its loop).",
    ),
]
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
SeqLen = Annotated[int, typer.Option("--seq-len", help="Tokens per sequence (at most the model's positions).")]
DTypeName = Annotated[str, typer.Option("--dtype", help="Training dtype: fp32, bf16 or fp16.")]

# The options of every command that prices a model on a fleet, declared once: each its name,
# its option and its default, in --help's order, where the command's ``setup`` parameter stands.
SETUP_OPTIONS: tuple[tuple[str, Any, Any], ...] = (
    ("model", ModelPreset, "small"),
    ("fleet", FleetSpec, "laptops"),
    ("devices", Devices, None),
    ("ps_link_gbps", PsLinkGbps, DEFAULT_LINK_GBPS),
    ("ps_gflops", PsGflops, None),
    ("ps_workers", PsWorkers, 1),
    ("coordinator", CoordinatorPreset, "server"),
    ("coordinators", Coordinators, 1),
    ("tier_link_gbps", TierLinkGbps, DEFAULT_TIER_GBPS),
    ("batch_size", opt.BatchSize, 8),
    ("seq_len", SeqLen, 256),
    ("dtype", DTypeName, DType.FP32.value),
)


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


def _setup(values: dict[str, Any], max_devices: int) -> Setup:
    """The setup the options' ``values`` describe; their bounds broken, a one-line usage error."""
    dtype, devices, batch_size = values["dtype"], values["devices"], values["batch_size"]
    seq_len, link_gbps = values["seq_len"], values["ps_link_gbps"]
    if dtype not in {d.value for d in DType}:
        raise ConfigError(f"unknown --dtype {dtype!r}; use one of {', '.join(d.value for d in DType)}")
    if devices is not None and not 1 <= devices <= max_devices:
        raise ConfigError(f"--devices must be between 1 and {max_devices:,}, got {devices}")
    if not 1 <= batch_size <= MAX_BATCH:
        raise ConfigError(f"--batch-size must be between 1 and {MAX_BATCH:,}, got {batch_size}")
    if seq_len < 1:
        raise ConfigError(f"--seq-len must be at least 1, got {seq_len}")
    if not (math.isfinite(link_gbps) and 0 < link_gbps <= 1e6):
        raise ConfigError(f"--ps-link-gbps must be above 0 and at most 1,000,000, got {link_gbps}")
    tier = tier_of(values["coordinators"], values["tier_link_gbps"], batch_size)
    ps = with_workers(coordinator_ps(values["coordinator"], link_gbps, values["ps_gflops"]), values["ps_workers"])
    return Setup(
        model=values["model"],
        fleet=values["fleet"],
        devices=devices,
        ps=ps,
        link_gbps=link_gbps,
        coordinator=values["coordinator"],
        tier=tier,
        batch=batch_size,
        seq=seq_len,
        dtype=dtype,
    )


def priced(max_devices: int) -> Callable[[F], F]:
    """``command`` with the setup's options (SETUP_OPTIONS) in the place of its ``setup``
    parameter, which gets the Setup they describe (a fleet of at most ``max_devices``)."""

    def decorate(command: F) -> F:
        own = inspect.signature(command, eval_str=True)  # typer reads the annotations as objects
        options = [
            inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=kind)
            for name, kind, default in SETUP_OPTIONS
        ]
        params = [q for p in own.parameters.values() for q in (options if p.name == "setup" else [p])]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name, _, _ in SETUP_OPTIONS}
            return command(setup=_setup(values, max_devices), **kwargs)

        wrapper.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params} | {"return": own.return_annotation}
        return wrapper  # type: ignore[return-value]

    return decorate


@friendly
@priced(PLAN_MAX_DEVICES)
def plan(setup: Setup, as_json: opt.AsJson = False) -> None:
    """Predict how every GEMM of one training step would be cut over a fleet, the step's time,
    traffic and memory, and the speedup over round-robin tiles."""
    # Transient: a terminal sees it while the baseline is priced, a pipe or a file never does.
    with stderr_console().status("planning ...") as status:
        report = plan_report(plan_fleet(setup, status.update))
    if as_json:
        opt.print_json(report, allow_nan=False)
        return
    # The GEMM table wants ~150 columns; rich assumes 80 when writing to a pipe or a file.
    wide = is_terminal() or "COLUMNS" in os.environ
    Console(highlight=False, width=None if wide else 160).print(render.plan_report(report))
