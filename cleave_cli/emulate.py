"""``cleave emulate``: a fleet of emulated volunteer devices in this one process, on a real
coordinator. Each is the real client, paced to a fleet profile (emulator/devices.py gives the
pacing model); this module only checks the options, shows progress and prints the summary."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.logging import RichHandler
from rich.table import Table
from rich.text import Text

from cleave.cli import options as opt
from cleave.cli.errors import friendly, is_terminal, stderr_console, stop_on_signals
from cleave.coordinator.planning.costmodel import ITEMSIZE
from cleave.coordinator.whatif.presets import FLEETS, resolve_fleet
from cleave.emulator.devices import Fleet, FleetConfig
from cleave.wire.errors import CleaveError, ConfigError

MAX_DEVICES = 10_000


def progress_line(snap: dict[str, Any]) -> Text:
    """One line of live counters."""
    line = Text(f"{snap['seconds']:6.0f} s  ", style="dim")
    line.append(f"{snap['connected']}/{snap['devices']} connected", style="bold")
    if snap["away"]:
        line.append(f" ({snap['away']} away)")
    line.append(
        f" · {snap['tiles']:,} tiles · down {snap['bytes_down'] / 1e6:,.1f} MB, up {snap['bytes_up'] / 1e6:,.1f} MB"
    )
    if snap["forged"] or snap["banned"]:
        line.append(
            f" · forged {snap['forged']} sent, {snap['forged_rejected']} rejected, {snap['banned']} banned", style="red"
        )
    line.append(f" · {snap['overruns']:,} overruns", style="yellow" if snap["overruns"] else "")
    line.append(f" · {snap['leaves']} leaves ({snap['crashes']} crashes), {snap['rejoins']} rejoins")
    return line


def summary_table(report: dict[str, Any]) -> Group:
    """The final summary: one row per device class, then the totals."""
    table = Table(title=f"cleave emulate: {report['devices']} devices on {report['url']}")
    for col in (
        "class",
        "devices",
        "GFLOP/s",
        "down / up Mbit/s",
        "RTT",
        "tiles",
        "rejected",
        "overruns",
        "leaves",
        "rejoins",
        "byzantine",
        "banned",
    ):
        table.add_column(col, justify="left" if col == "class" else "right", no_wrap=True)
    for c in report["classes"]:
        table.add_row(
            Text(c["name"]),
            str(c["devices"]),
            f"{c['gflops']:,.3g}",
            f"{c['down_mbps']:,.3g} / {c['up_mbps']:,.3g}",
            f"{c['rtt_ms']:,.3g} ms",
            f"{c['tiles']:,}",
            f"{c['rejected']:,}",
            f"{c['overruns']:,}",
            str(c["leaves"]),
            str(c["rejoins"]),
            str(c["byzantine"]),
            str(c["banned"]),
        )
    verdict = "the job finished" if report["finished"] else "stopped before the job finished"
    lines = [
        table,
        Text(
            f"{verdict} after {report['seconds']:,.1f} s: {report['tiles']:,} tiles computed, {report['rejected']:,} "
            f"rejected; {report['forged']:,} forged results sent by {len(report['byzantine'])} byzantine devices, "
            f"{len(report['banned'])} devices banned; {report['leaves']['graceful']} graceful leaves, "
            f"{report['leaves']['crash']} crashes, {report['rejoins']} rejoins"
        ),
    ]
    if report["overruns"]:
        lines.append(
            Text(
                f"{report['overruns']:,} tiles took longer on this host than their profile allows: the "
                "fleet ran slower than emulated (lower its rates or raise --speed)",
                style="yellow",
            )
        )
    return Group(*lines)


@friendly
def emulate(
    url: Annotated[str, typer.Argument(help="Coordinator address, e.g. ws://127.0.0.1:8765")],
    devices: Annotated[
        int, typer.Option("--devices", help="Devices to emulate; the fleet's classes keep their proportions.")
    ],
    fleet: Annotated[
        str,
        typer.Option(
            "--fleet",
            help=f"Fleet preset ({', '.join(FLEETS)}) or a TOML fleet file (docs/presets.md): "
            "each device gets its class's profile.",
        ),
    ],
    token: Annotated[
        str | None,
        opt.secret_option(
            "--token", "The coordinator's join token: every emulated device enrols with it.", opt.Secret.JOIN_TOKEN
        ),
    ] = None,
    token_file: opt.TokenFile = None,
    leave_rate: Annotated[
        float,
        typer.Option(
            "--leave-rate",
            help="Leaves per device per minute (exponential); half graceful, half crashes. 0: nobody leaves.",
        ),
    ] = 0.0,
    away_seconds: Annotated[
        float, typer.Option("--away-seconds", help="Mean seconds a device stays away before it rejoins (exponential).")
    ] = 10.0,
    byzantine: Annotated[
        float,
        typer.Option("--byzantine", help="Share of devices that return forged results (at least one when above 0)."),
    ] = 0.0,
    seed: Annotated[
        int, typer.Option("--seed", help="Seed of who forges, and of every device's leaves and forgeries.")
    ] = 0,
    dtype: Annotated[
        str,
        typer.Option(
            "--dtype", help="Which of the profiles' rates to pace compute with: fp32, bf16 or fp16 (the job's dtype)."
        ),
    ] = "fp32",
    speed: Annotated[
        float,
        typer.Option(
            "--speed",
            help="Slow motion: every paced time is X times the profile's "
            "(X > 1 lets a slow host emulate a fast fleet).",
        ),
    ] = 1.0,
    threads: Annotated[
        int,
        typer.Option(
            "--threads", help="Real products computed at once (one torch thread each), shared by all devices."
        ),
    ] = 1,
    slots: Annotated[int, typer.Option("--slots", help="Tiles each device asks to hold (prefetch).")] = 2,
    magnitude: Annotated[
        float, typer.Option("--magnitude", help="Size of forged errors, in detection thresholds.")
    ] = 4.0,
    interval: Annotated[
        float, typer.Option("--interval", help="Seconds between progress lines when not on a terminal.")
    ] = 5.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON summary at the end (progress goes to stderr).")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress; only the summary.")] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Log every leave, crash, rejoin and ban (to stderr).")
    ] = False,
    cafile: opt.CaFile = None,
    insecure: opt.Insecure = False,
) -> None:
    """Emulate a fleet of volunteer devices in one process: each joins the coordinator as a real
    client and computes its tiles for real, paced to its class's compute rate and links. Exits
    when the coordinator finishes the job, or on Ctrl-C (every device leaves gracefully)."""
    token = opt.read_secret(token, token_file, "--token", opt.Secret.JOIN_TOKEN)
    if not token:
        raise ConfigError("every emulated device enrols with the join token: set CLEAVE_TOKEN or pass --token-file")
    if not 1 <= devices <= MAX_DEVICES:
        raise ConfigError(f"--devices must be between 1 and {MAX_DEVICES:,}, got {devices}")
    if dtype not in ITEMSIZE:
        raise ConfigError(f"unknown --dtype {dtype!r}; use one of {', '.join(ITEMSIZE)}")
    if not 0.1 <= interval <= 3600:
        raise ConfigError(f"--interval must be between 0.1 and 3600 s, got {interval}")
    if not 1 <= slots <= 8:
        raise ConfigError(f"--slots must be between 1 and 8, got {slots}")
    classes = resolve_fleet(fleet, dtype, devices)
    cfg = FleetConfig(
        url=url,
        token=token,
        classes=classes,
        dtype=dtype,
        speed=speed,
        leave_rate=leave_rate,
        away_seconds=away_seconds,
        byzantine=byzantine,
        seed=seed,
        magnitude=magnitude,
        compute_threads=threads,
        slots=slots,
        cafile=str(cafile) if cafile else None,
        insecure=insecure,
    )
    runner = Fleet(cfg)
    # N devices' warnings (a rejected forgery, a reconnect) would drown the progress: the summary counts them.
    logging.getLogger("cleave.client").setLevel(logging.ERROR)
    if verbose:
        handler = RichHandler(console=stderr_console(), show_path=False, markup=False, rich_tracebacks=False)
        logging.basicConfig(level=logging.WARNING, handlers=[handler], format="%(message)s", force=True)
        logging.getLogger("cleave.emulator").setLevel(logging.INFO)
    # The table wants ~120 columns; rich assumes 80 when writing to a pipe or a file.
    out = Console(highlight=False, width=None if is_terminal() or "COLUMNS" in os.environ else 140)
    shown = stderr_console() if as_json else out
    live = is_terminal() and not (quiet or as_json)
    report, stopped = asyncio.run(_run(runner, shown, live=live, quiet=quiet, interval=interval))
    if as_json:
        opt.print_json(report, allow_nan=False)
    else:
        out.print(summary_table(report))
    if not (report["finished"] or stopped):
        raise CleaveError("every device stopped before the job finished")


async def _run(fleet: Fleet, console: Console, *, live: bool, quiet: bool, interval: float) -> tuple[dict, bool]:
    stopped = False

    def stop() -> None:
        nonlocal stopped
        stopped = True
        fleet.request_stop()

    stop_on_signals(stop)
    task = asyncio.create_task(fleet.run())
    board = Live(console=console, refresh_per_second=2, transient=False) if live else None
    if board is not None:
        board.start()
    try:
        last = time.monotonic()
        while not task.done():
            await asyncio.wait({task}, timeout=0.5 if board is not None else min(interval, 0.5))
            if board is not None:
                board.update(progress_line(fleet.snapshot()))
            elif not quiet and time.monotonic() - last >= interval:
                console.print(progress_line(fleet.snapshot()), soft_wrap=True)
                last = time.monotonic()
        return task.result(), stopped
    finally:
        if board is not None:
            board.update(progress_line(fleet.snapshot()))
            board.stop()
