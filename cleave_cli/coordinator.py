"""``cleave coordinator``: start the parameter server; manage its devices and tokens on its --db."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler

from cleave_cli import options as opt
from cleave_cli import render
from cleave_cli.errors import friendly, is_terminal, stderr_console
from cleave_cli.progress import ConsoleReporter
from coordinator.engine.identity import JOIN_TOKEN, OPERATOR_TOKEN, store_token
from coordinator.engine.limits import Limits
from coordinator.engine.live_plan import Planner
from coordinator.engine.scheduler import FaultPolicy
from coordinator.job import STRONG_TOKEN, CoordinatorConfig, new_token, run_job
from coordinator.planning.tiles import TilingPolicy
from coordinator.wire.auth import token_hash
from coordinator.wire.errors import ConfigError
from coordinator.wire.messages import MAX_TOKEN, WireDtype
from db.sqlite import SQLiteStore
from db.store import IdentityState

app = typer.Typer(help="Run a coordinator (parameter server + tile queue) and manage it.", no_args_is_help=True)
devices_app = typer.Typer(
    help="The devices enrolled on a coordinator's --db: list, revoke, unban.", no_args_is_help=True
)
token_app = typer.Typer(help="The coordinator's join and operator tokens.", no_args_is_help=True)
app.add_typer(devices_app, name="devices")
app.add_typer(token_app, name="token")
D = opt.DEFAULTS
Db = Annotated[Path, typer.Option(help="The coordinator's SQLite file.")]


def setup_logging(console: Console, verbose: bool) -> None:
    handler = RichHandler(console=console, show_path=False, markup=False, rich_tracebacks=False)
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, handlers=[handler], format="%(message)s", force=True
    )


@app.command("start")
@friendly
def start(
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0 to accept other machines).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port; 0 picks a free one (printed).")] = 8765,
    db: Annotated[Path, typer.Option(help="SQLite file holding the job, devices and tile history.")] = Path(
        "cleave.db"
    ),
    token: Annotated[
        str | None,
        typer.Option(help="Join token devices enrol with. Default: the database's, else a generated one (printed)."),
    ] = None,
    operator_token: Annotated[
        str | None,
        typer.Option(
            "--operator-token",
            help="Token for cleave status and link tests. Default: the database's, else a generated one (printed).",
        ),
    ] = None,
    certfile: Annotated[
        Path | None, typer.Option("--certfile", help="Serve wss:// with this certificate chain (PEM).")
    ] = None,
    keyfile: Annotated[Path | None, typer.Option("--keyfile", help="The private key of --certfile (PEM).")] = None,
    max_connections: Annotated[
        int, typer.Option("--max-connections", help="Open connections at most; more are refused with close code 1013.")
    ] = Limits().max_connections,
    model: opt.Model = D.model,
    steps: opt.Steps = D.steps,
    batch_size: opt.BatchSize = D.batch_size,
    seq_len: opt.SeqLen = D.seq_len,
    lr: opt.Lr = D.lr,
    seed: opt.Seed = D.seed,
    data: opt.Data = None,
    precision: opt.Precision = D.precision,
    metrics: opt.Metrics = None,
    min_devices: Annotated[
        int, typer.Option("--min-devices", help="Wait until this many devices joined before step 1.")
    ] = 1,
    tile_size: Annotated[int, typer.Option("--tile-size", help="Largest output-tile edge in rows/columns.")] = 512,
    checkpoint_every: Annotated[
        int,
        typer.Option("--checkpoint-every", help="Checkpoint the parameter server every N steps (0: only at the end)."),
    ] = 50,
    heartbeat_timeout: Annotated[
        float,
        typer.Option(
            "--heartbeat-timeout",
            help="Seconds of silence after which a device is dropped (its tiles are copied "
            "elsewhere once their deadlines pass, usually sooner).",
        ),
    ] = 30.0,
    lease_floor: Annotated[
        float,
        typer.Option(
            "--lease-floor",
            help="Seconds every lease deadline allows at least (a tile is copied once its deadline "
            "passes, and taken back at twice it).",
        ),
    ] = FaultPolicy().lease_floor,
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
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only the URL, tokens and final result.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every device that joins or leaves.")] = False,
) -> None:
    """Start a coordinator and train one job; exits 0 once every step is done and every device was told."""
    console = Console(highlight=False)
    setup_logging(Console(stderr=True), verbose)
    if not 16 <= tile_size <= 16384:
        raise ConfigError(f"--tile-size must be between 16 and 16384, got {tile_size}")
    if not 0.5 <= heartbeat_timeout <= 3600:
        raise ConfigError(f"--heartbeat-timeout must be between 0.5 and 3600 s, got {heartbeat_timeout}")
    if not 0.1 <= lease_floor <= 3600:
        raise ConfigError(f"--lease-floor must be between 0.1 and 3600 s, got {lease_floor}")
    if not 1 <= max_connections <= 1_000_000:
        raise ConfigError(f"--max-connections must be between 1 and 1,000,000, got {max_connections}")
    limits = Limits(
        max_connections=max_connections,
        max_unauthenticated=min(Limits().max_unauthenticated, max_connections),
        max_observers=min(Limits().max_observers, max_connections),
    )
    cfg = CoordinatorConfig(
        train=opt.train_config(model, steps, batch_size, seq_len, lr, seed, data, precision),
        host=host,
        port=port,
        db=str(db),
        token=token,
        operator_token=operator_token,
        certfile=str(certfile) if certfile else None,
        keyfile=str(keyfile) if keyfile else None,
        metrics=str(metrics) if metrics else None,
        min_devices=min_devices,
        policy=TilingPolicy(max_edge=tile_size, min_edge=min(64, tile_size)),
        faults=FaultPolicy(
            heartbeat=min(2.0, heartbeat_timeout / 5), heartbeat_timeout=heartbeat_timeout, lease_floor=lease_floor
        ),
        limits=limits,
        checkpoint_every=checkpoint_every,
        new_job=new_job,
        planner=planner,
        ps_link_gbps=ps_link_gbps,
        ps_gflops=ps_gflops,
        wire_dtype=wire_dtype,
    )
    reporter = ConsoleReporter(console, live=is_terminal(), quiet=quiet)
    try:
        run_job(cfg, reporter)
    finally:
        reporter.close()


def _open(db: Path) -> SQLiteStore:
    if not db.exists():
        raise ConfigError(f"no database at {db} (pass the coordinator's --db)")
    return SQLiteStore(db)


@devices_app.command("list")
@friendly
def devices_list(
    db: Db = Path("cleave.db"),
    limit: Annotated[int, typer.Option(help="Show at most this many, newest first.")] = 200,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON list.")] = False,
) -> None:
    """List enrolled devices: state, record and verified work (works while the coordinator runs)."""
    if not 1 <= limit <= 1_000_000:
        raise ConfigError(f"--limit must be between 1 and 1,000,000, got {limit}")
    store = _open(db)
    try:
        rows = store.identities(limit)
    finally:
        store.close()
    console = Console(highlight=False)
    if as_json:
        console.out(
            json.dumps([{**row.__dict__, "reliability": round(row.reliability, 4)} for row in rows], sort_keys=True)
        )
    else:
        console.print(render.identities(rows))


def _set_state(db: Path, identity: int, want: str, reason: str, allowed_from: tuple[str, ...]) -> str:
    store = _open(db)
    try:
        row = store.identity(identity)
        if row is None:
            raise ConfigError(f"no device #{identity} in {db}")
        if row.state not in allowed_from:
            raise ConfigError(f"device #{identity} ({row.name}) is {row.state}")
        store.set_identity_state(identity, want, reason, time.time())
        return row.name
    finally:
        store.close()


@devices_app.command("revoke")
@friendly
def devices_revoke(
    identity: Annotated[int, typer.Argument(help="The device's number (cleave coordinator devices list).")],
    db: Db = Path("cleave.db"),
    reason: Annotated[str, typer.Option(help="Recorded, and shown to the device when it is refused.")] = "",
) -> None:
    """Revoke a device's credential: a running coordinator cuts it within a second and refuses it
    from then on. Its record and credit stay."""
    name = _set_state(db, identity, IdentityState.REVOKED, reason[:200], (IdentityState.ACTIVE, IdentityState.BANNED))
    Console(highlight=False).print(f"device #{identity} ({name}) revoked", markup=False)


@devices_app.command("unban")
@friendly
def devices_unban(
    identity: Annotated[int, typer.Argument(help="The device's number (cleave coordinator devices list).")],
    db: Db = Path("cleave.db"),
) -> None:
    """Let a banned device connect again; its record stays. A revoked credential cannot be
    reinstated: that device enrols again with the join token (cleave join --new-identity)."""
    name = _set_state(db, identity, IdentityState.ACTIVE, "", (IdentityState.BANNED,))
    Console(highlight=False).print(f"device #{identity} ({name}) may connect again", markup=False)


@token_app.command("rotate")
@friendly
def token_rotate(
    db: Db = Path("cleave.db"),
    operator: Annotated[
        bool, typer.Option("--operator", help="Rotate the operator token instead of the join token.")
    ] = False,
    token: Annotated[str | None, typer.Option(help="The new token. Default: a generated one (printed).")] = None,
) -> None:
    """Replace the join token (enrolled devices are not affected: they use their credentials) or
    the operator token. A running coordinator on --db uses the new one within a second."""
    new = token if token is not None else new_token()
    if not (new.strip() and new.isprintable() and len(new) <= MAX_TOKEN):
        raise ConfigError(f"--token must be 1 to {MAX_TOKEN} printable characters")
    if len(new) < STRONG_TOKEN:
        stderr_console().print(
            f"warning: a token of {len(new)} characters can be searched for by anyone who copies "
            "the database; generated tokens have 22",
            style="yellow",
        )
    store = _open(db)
    try:
        mine, other = (OPERATOR_TOKEN, JOIN_TOKEN) if operator else (JOIN_TOKEN, OPERATOR_TOKEN)
        if store.setting(other) == token_hash(new).hex():
            raise ConfigError("the join and operator tokens must differ")
        store_token(store, mine, new)
    finally:
        store.close()
    which = "operator" if operator else "join"
    Console(highlight=False).print(f"new {which} token: {new}", markup=False)
