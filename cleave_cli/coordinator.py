"""``cleave coordinator start``: the parameter server and its tile queue."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.logging import RichHandler

from cleave_cli import options as opt
from cleave_cli.errors import friendly, is_terminal
from cleave_cli.progress import ConsoleReporter
from coordinator.core import FaultPolicy
from coordinator.job import CoordinatorConfig, run_job
from coordinator.tiles import TilingPolicy

app = typer.Typer(help="Run a coordinator (parameter server + tile queue).", no_args_is_help=True)
D = opt.DEFAULTS


def setup_logging(console: Console, verbose: bool) -> None:
    handler = RichHandler(console=console, show_path=False, markup=False, rich_tracebacks=False)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler], format="%(message)s", force=True)


@app.command("start")
@friendly
def start(
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0 to accept other machines).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port; 0 picks a free one (printed).")] = 8765,
    db: Annotated[Path, typer.Option(help="SQLite file holding the job, devices and tile history.")] = Path("cleave.db"),
    token: Annotated[Optional[str], typer.Option(help="Shared secret devices must present. Default: a generated one, printed.")] = None,
    model: opt.Model = D.model,
    steps: opt.Steps = D.steps,
    batch_size: opt.BatchSize = D.batch_size,
    seq_len: opt.SeqLen = D.seq_len,
    lr: opt.Lr = D.lr,
    seed: opt.Seed = D.seed,
    data: opt.Data = None,
    metrics: opt.Metrics = None,
    min_devices: Annotated[int, typer.Option("--min-devices", help="Wait until this many devices joined before step 1.")] = 1,
    tile_size: Annotated[int, typer.Option("--tile-size", help="Largest output-tile edge in rows/columns.")] = 512,
    checkpoint_every: Annotated[int, typer.Option(
        "--checkpoint-every", help="Checkpoint the parameter server every N steps (0: only at the end).")] = 50,
    heartbeat_timeout: Annotated[float, typer.Option(
        "--heartbeat-timeout", help="Seconds of silence after which a device is dropped (its tiles are copied "
        "elsewhere once their deadlines pass, usually sooner).")] = 30.0,
    new_job: Annotated[bool, typer.Option(
        "--new-job", help="Start a new job even if --db holds an unfinished one (default: resume it).")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only the URL, token and final result.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every device that joins or leaves.")] = False,
) -> None:
    """Start a coordinator and train one job; exits 0 once every step is done and every device was told."""
    console = Console(highlight=False)
    setup_logging(Console(stderr=True), verbose)
    if not 16 <= tile_size <= 16384:
        raise ValueError(f"--tile-size must be between 16 and 16384, got {tile_size}")
    if not 0.5 <= heartbeat_timeout <= 3600:
        raise ValueError(f"--heartbeat-timeout must be between 0.5 and 3600 s, got {heartbeat_timeout}")
    cfg = CoordinatorConfig(
        train=opt.train_config(model, steps, batch_size, seq_len, lr, seed, data),
        host=host, port=port, db=str(db), token=token, metrics=str(metrics) if metrics else None,
        min_devices=min_devices, policy=TilingPolicy(max_edge=tile_size, min_edge=min(64, tile_size)),
        faults=FaultPolicy(heartbeat=min(2.0, heartbeat_timeout / 5), heartbeat_timeout=heartbeat_timeout),
        checkpoint_every=checkpoint_every, new_job=new_job,
    )
    reporter = ConsoleReporter(console, live=is_terminal(), quiet=quiet)
    try:
        run_job(cfg, reporter)
    finally:
        reporter.close()
