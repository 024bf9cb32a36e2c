"""``cleave status``: a dashboard of a running coordinator (or one JSON object with --json)."""

from __future__ import annotations

import contextlib
import ssl
import time
from collections.abc import Iterator
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.sync.client import ClientConnection, connect

from cleave.cli import options as opt
from cleave.cli import render
from cleave.cli.errors import friendly, is_terminal
from cleave.client.connection import URLRefused, check_url, client_tls
from cleave.wire.codes import CloseCode, JobPhase
from cleave.wire.errors import CleaveError, ConfigError, ProtocolError
from cleave.wire.messages import Challenge, StatusReply, StatusRequest, decode, encode

TIMEOUT = 10.0  # seconds to wait for any answer
MAX_INTERVAL = 30.0  # seconds between refreshes: well inside the coordinator's idle limit for observers


def _ask(ws: ClientConnection, token: str) -> dict[str, Any] | None:
    """One status snapshot; None when the coordinator closed with 1000 (the job is over and it
    is leaving). Any other end of the connection is a one-line ``CleaveError``."""
    try:
        ws.send(encode(StatusRequest(token)))
        reply = decode(ws.recv(timeout=TIMEOUT))
    except ConnectionClosed:
        code = ws.close_code
        if code == CloseCode.AUTH:
            raise ConfigError(f"the coordinator refused the token ({ws.close_reason})") from None
        if code == CloseCode.FINISHED:
            return None
        why = f"{code} {ws.close_reason}".strip() if code is not None else "no close code"
        raise CleaveError(f"the coordinator closed the connection ({why})") from None
    except TimeoutError:
        raise CleaveError(f"the coordinator did not answer within {TIMEOUT:g} s") from None
    if not isinstance(reply, StatusReply):
        raise ProtocolError(f"expected a status reply, got {reply.TYPE}")
    return reply.status


def fetch_status(url: str, token: str, *, cafile: str | None = None, insecure: bool = False) -> dict[str, Any]:
    with _open(url, cafile, insecure) as ws:
        snapshot = _ask(ws, token)
    if snapshot is None:
        raise CleaveError("the job is over and the coordinator is leaving: nothing left to show")
    return snapshot


def _where(snapshot: dict[str, Any] | None) -> str:
    job = (snapshot or {}).get("job") or {}
    return f"step {job.get('step') or 0:,}/{job.get('steps') or 0:,}" if job else "before the first answer"


def _watch(
    console: Console, url: str, token: str, ca: str | None, insecure: bool, interval: float, rank_by: str = "gflop"
) -> None:
    """The live dashboard until the job finishes (the summary, exit 0) or the connection ends
    otherwise (one line saying where the job was, exit 1)."""
    last: dict[str, Any] | None = None
    try:
        with _open(url, ca, insecure) as ws, Live(console=console, refresh_per_second=4) as live:
            while True:
                snapshot = _ask(ws, token)
                if snapshot is None:  # closed with 1000: the job finished since the last refresh
                    break
                last = snapshot
                live.update(render.dashboard(snapshot, rank_by=rank_by))
                if snapshot.get("job", {}).get("state") == JobPhase.FINISHED:
                    break
                time.sleep(interval)
    except ConfigError:
        raise
    except CleaveError as exc:
        raise CleaveError(f"{exc}; the job was at {_where(last)}") from None
    console.print(render.job_summary(last), highlight=False)


@contextlib.contextmanager
def _open(url: str, cafile: str | None = None, insecure: bool = False) -> Iterator[ClientConnection]:
    try:
        check_url(url, insecure=insecure)
        tls = client_tls(url, cafile)
    except URLRefused as exc:
        raise ConfigError(str(exc)) from None
    try:
        conn = connect(url, compression=None, max_size=64 << 20, open_timeout=TIMEOUT, proxy=None, ssl=tls)
    except InvalidURI as exc:
        raise ConfigError(f"bad coordinator URL: {exc}") from None
    except ssl.SSLCertVerificationError as exc:
        raise ConfigError(f"the coordinator's TLS certificate does not verify: {exc.verify_message}") from None
    except (OSError, InvalidHandshake, TimeoutError) as exc:
        raise CleaveError(f"cannot reach a coordinator at {url}: {exc}") from None
    with conn as ws:
        try:  # every connection opens with the coordinator's challenge; observers just read it
            first = decode(ws.recv(timeout=TIMEOUT))
        except (ConnectionClosed, TimeoutError, ProtocolError) as exc:
            raise CleaveError(f"the coordinator at {url} did not greet us ({exc})") from None
        if not isinstance(first, Challenge):
            raise CleaveError(f"the coordinator at {url} speaks another protocol version (got {first.TYPE})")
        yield ws


@friendly
def status(
    token: Annotated[
        str | None,
        opt.secret_option(
            "--token", "The coordinator's operator token (not the join token).", opt.Secret.OPERATOR_TOKEN
        ),
    ] = None,
    token_file: opt.StatusTokenFile = None,
    url: Annotated[str, typer.Option("--url", help="Coordinator address.")] = "ws://127.0.0.1:8765",
    cafile: opt.CaFile = None,
    insecure: opt.Insecure = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (job, devices, tiles) and exit.")
    ] = False,
    watch: Annotated[
        bool, typer.Option("--watch/--once", help="Keep the dashboard live (default on a terminal).")
    ] = True,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes with --watch.")] = 1.0,
    rank_by: Annotated[
        str,
        typer.Option(
            "--rank-by",
            help="Rank the leaderboard by verified work ('gflop') or by verified GFLOP per joule ('efficiency').",
        ),
    ] = "gflop",
) -> None:
    """Show the job's step and loss, throughput, devices and the tile queue."""
    token = opt.read_secret(token, token_file, "--token", opt.Secret.OPERATOR_TOKEN)
    if not token:
        raise ConfigError("the operator token is needed: set CLEAVE_OPERATOR_TOKEN or pass --token-file")
    if rank_by not in ("gflop", "efficiency"):
        raise ConfigError(f"--rank-by must be gflop or efficiency, got {rank_by!r}")
    if not 0.5 <= interval <= MAX_INTERVAL:
        raise ConfigError(f"--interval must be between 0.5 and {MAX_INTERVAL:g} s, got {interval}")
    console = Console(highlight=False)
    ca = str(cafile) if cafile else None
    if as_json:
        opt.print_json(fetch_status(url, token, cafile=ca, insecure=insecure))
        return
    if not (watch and is_terminal()):
        snapshot = fetch_status(url, token, cafile=ca, insecure=insecure)
        console.print(render.dashboard(snapshot, rank_by=rank_by))
        if snapshot.get("job", {}).get("state") == JobPhase.FINISHED:
            console.print(render.job_summary(snapshot), highlight=False)
        return
    _watch(console, url, token, ca, insecure, interval, rank_by)
