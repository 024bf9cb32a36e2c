"""``cleave coordinator``: start the parameter server; manage its devices and tokens on its --db."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler

from cleave.cli import options as opt
from cleave.cli.errors import friendly, is_terminal
from cleave.cli.progress import ConsoleReporter
from cleave.coordinator.config import DEFAULT_SEND_THREADS, LINGER, CoordinatorConfig, TierOptions
from cleave.coordinator.engine.limits import Limits
from cleave.coordinator.engine.live_plan import Planner
from cleave.coordinator.engine.scheduler import FaultPolicy
from cleave.coordinator.engine.standby import StandbyPolicy
from cleave.coordinator.job import run_job
from cleave.coordinator.planning.tiles import TilingPolicy
from cleave.coordinator.tier.group import TIER_TIMEOUT
from cleave.coordinator.training.loop import TrainConfig
from cleave.wire.errors import ConfigError
from cleave.wire.messages import WireDtype


def setup_logging(console: Console, verbose: bool) -> None:
    handler = RichHandler(console=console, show_path=False, markup=False, rich_tracebacks=False)
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, handlers=[handler], format="%(message)s", force=True
    )


@friendly
@opt.train_options
def start(
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0 to accept other machines).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port; 0 picks a free one (printed).")] = 8765,
    public_url: Annotated[
        str | None,
        typer.Option(
            "--public-url",
            help="The address volunteers reach this coordinator at, when it is not --host:--port (a proxy, "
            "NAT, the name on its certificate): printed in the join command, and where a tier's other ranks "
            "send newcomers.",
        ),
    ] = None,
    db: Annotated[Path, typer.Option(help="SQLite file holding the job, devices and tile history.")] = opt.DEFAULT_DB,
    token: Annotated[
        str | None,
        opt.secret_option(
            "--token",
            "Join token devices enrol with. Default: CLEAVE_TOKEN, else the database's, else a generated one "
            "(printed).",
            opt.Secret.JOIN_TOKEN,
        ),
    ] = None,
    token_file: opt.TokenFile = None,
    operator_token: Annotated[
        str | None,
        opt.secret_option(
            "--operator-token",
            "Token for cleave status and link tests. Default: CLEAVE_OPERATOR_TOKEN, else the database's, "
            "else a generated one (printed).",
            opt.Secret.OPERATOR_TOKEN,
        ),
    ] = None,
    operator_token_file: opt.OperatorTokenFile = None,
    certfile: Annotated[
        Path | None, typer.Option("--certfile", help="Serve wss:// with this certificate chain (PEM).")
    ] = None,
    keyfile: Annotated[Path | None, typer.Option("--keyfile", help="The private key of --certfile (PEM).")] = None,
    max_connections: Annotated[
        int, typer.Option("--max-connections", help="Open connections at most; more are refused with close code 1013.")
    ] = Limits().max_connections,
    train: TrainConfig = TrainConfig(),  # the training options (opt.train_options)
    device: opt.Device = "auto",
    metrics: opt.Metrics = None,
    min_devices: Annotated[
        int, typer.Option("--min-devices", help="Wait until this many devices joined before step 1.")
    ] = 1,
    tile_size: Annotated[
        int, typer.Option("--tile-size", help="Largest output-tile edge in rows/columns.")
    ] = TilingPolicy().max_edge,
    checkpoint_every: Annotated[
        int,
        typer.Option("--checkpoint-every", help="Checkpoint the parameter server every N steps (0: only at the end)."),
    ] = 50,
    prune_steps: Annotated[
        int,
        typer.Option(
            "--prune-steps",
            help="At each checkpoint, delete the database rows (GEMMs, tiles, leases) of finished GEMMs older "
            "than the last N steps, keeping their counts: the store stays bounded in steps (0: keep every row).",
        ),
    ] = 0,
    linger: Annotated[
        float,
        typer.Option(
            "--linger",
            help="Seconds a finished job stays visible (the web page, cleave status, /metrics) before the "
            "coordinator exits; 0 exits at once, Ctrl-C ends the wait.",
        ),
    ] = LINGER,
    heartbeat_timeout: Annotated[
        float,
        typer.Option(
            "--heartbeat-timeout",
            help="Seconds of silence after which a device is dropped (its tiles are copied "
            "elsewhere once their deadlines pass, usually sooner).",
        ),
    ] = FaultPolicy().heartbeat_timeout,
    lease_floor: Annotated[
        float,
        typer.Option(
            "--lease-floor",
            help="Seconds every lease deadline allows at least (a tile is copied once its deadline "
            "passes, and taken back at twice it).",
        ),
    ] = FaultPolicy().lease_floor,
    standby_after: Annotated[
        float,
        typer.Option(
            "--standby-after",
            help="Seconds a device has held no tile and been left out of every live GEMM's plan before it is "
            "sent to standby (it beats rarely and holds no memory until a plan needs it); 0: never.",
        ),
    ] = StandbyPolicy().after,
    standby_keepalive: Annotated[
        float,
        typer.Option(
            "--standby-keepalive",
            help="Seconds between the heartbeats of a device in standby (1-3600); it counts as silent after 3.",
        ),
    ] = StandbyPolicy().keepalive,
    new_job: Annotated[
        bool,
        typer.Option("--new-job", help="Start a new job even if --db holds an unfinished one (default: resume it)."),
    ] = False,
    planner: Annotated[
        Planner,
        typer.Option(
            "--planner",
            help="How each GEMM is cut and shared out: 'cost' (the cost model picks the partition and "
            "each device's share from measured profiles) or 'uniform' (a fixed grid dealt to whoever is free).",
            case_sensitive=False,
        ),
    ] = Planner.COST,
    ps_link_gbps: Annotated[
        float,
        typer.Option("--ps-link-gbps", help="This coordinator's network link in Gbit/s each way, for the cost model."),
    ] = 10.0,
    send_threads: Annotated[
        int,
        typer.Option(
            "--send-threads",
            help="Threads that write devices' sockets beside the event loop (0: the loop writes them itself).",
        ),
    ] = DEFAULT_SEND_THREADS,
    ps_gflops: Annotated[
        float | None,
        typer.Option(
            "--ps-gflops",
            help="The GEMM rate the cost model may count on from this coordinator, in GFLOP/s "
            "(default: measured at start). Lower it to keep its CPU for verification and the model's other work: "
            "fewer GEMMs stay on it.",
        ),
    ] = None,
    wire_dtype: opt.WireDtypeOpt = WireDtype.FP32,
    grid_gco2_kwh: opt.GridOpt = None,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size",
            help="Run this job across this many coordinators (ranks), each training its slice of every batch "
            "through its own devices (docs/operations.md, Running a tier). Needs --rank and --rendezvous.",
        ),
    ] = None,
    rank: Annotated[
        int | None, typer.Option("--rank", help="This coordinator's rank in the tier, 0 to --world-size - 1.")
    ] = None,
    rendezvous: Annotated[
        str | None,
        typer.Option(
            "--rendezvous",
            help="Where the ranks meet: tcp://HOST:PORT (rank 0 listens there; a private network only) or env:// "
            "(under torchrun).",
        ),
    ] = None,
    tier_secret: Annotated[
        str | None,
        opt.secret_option(
            "--tier-secret",
            "The secret every rank proves before it counts as one (the same on every rank). Default: "
            "CLEAVE_TIER_SECRET.",
            opt.Secret.TIER_SECRET,
        ),
    ] = None,
    tier_secret_file: opt.TierSecretFile = None,
    tier_timeout: Annotated[
        float,
        typer.Option(
            "--tier-timeout", help="Seconds without a heartbeat before a rank counts as lost and the others stop."
        ),
    ] = TIER_TIMEOUT,
    redirect: Annotated[
        bool,
        typer.Option(
            "--redirect/--no-redirect",
            help="On a tier: send a new volunteer to the rank whose pool is weakest (--no-redirect keeps every "
            "newcomer here, for an operator who assigns volunteers to ranks).",
        ),
    ] = True,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only the URL, tokens and final result.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every device that joins or leaves.")] = False,
) -> None:
    """Start a coordinator and train one job; once every step is done and every device was told, it
    keeps showing the finished job for --linger seconds, then exits 0."""
    console = Console(highlight=False)
    setup_logging(Console(stderr=True), verbose)
    token = opt.read_secret(token, token_file, "--token", opt.Secret.JOIN_TOKEN)
    operator_token = opt.read_secret(operator_token, operator_token_file, "--operator-token", opt.Secret.OPERATOR_TOKEN)
    tier_secret = opt.read_secret(tier_secret, tier_secret_file, "--tier-secret", opt.Secret.TIER_SECRET)
    # The command's own bounds: the policies take more (a test's 8-row tiles, a bench's endless leases).
    if not 16 <= tile_size <= 16384:
        raise ConfigError(f"--tile-size must be between 16 and 16384, got {tile_size}")
    opt.check_heartbeat_timeout(heartbeat_timeout)
    if not 0.1 <= lease_floor <= 3600:
        raise ConfigError(f"--lease-floor must be between 0.1 and 3600 s, got {lease_floor}")
    if rendezvous is None and (world_size is not None or rank is not None):
        raise ConfigError("a tier needs --rendezvous tcp://HOST:PORT (or env:// under torchrun)")
    with opt.as_flags():  # the configuration checks the values, and names the flags that set them
        tier = None
        if rendezvous is not None:
            tier = TierOptions(rendezvous, rank, world_size, tier_secret or "", tier_timeout, redirect)
        cfg = CoordinatorConfig(
            tier=tier,
            train=train,
            device=device,
            host=host,
            public_url=public_url,
            port=port,
            db=str(db),
            token=token,
            operator_token=operator_token,
            certfile=str(certfile) if certfile else None,
            keyfile=str(keyfile) if keyfile else None,
            metrics=str(metrics) if metrics else None,
            min_devices=min_devices,
            policy=TilingPolicy(max_edge=tile_size, min_edge=min(64, tile_size)),
            faults=FaultPolicy(heartbeat_timeout=heartbeat_timeout, lease_floor=lease_floor),
            standby=StandbyPolicy(after=standby_after, keepalive=standby_keepalive),
            limits=Limits(max_connections=max_connections),
            checkpoint_every=checkpoint_every,
            prune_steps=prune_steps,
            linger=linger,
            new_job=new_job,
            planner=planner,
            ps_link_gbps=ps_link_gbps,
            ps_gflops=ps_gflops,
            send_threads=send_threads,
            wire_dtype=wire_dtype,
            **({} if grid_gco2_kwh is None else {"grid_gco2_kwh": grid_gco2_kwh}),
        )
    reporter = ConsoleReporter(console, live=is_terminal(), quiet=quiet)
    try:
        run_job(cfg, reporter)
    finally:
        reporter.close()
