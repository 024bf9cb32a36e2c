"""``cleave status``: a dashboard of a running coordinator (or one JSON object with --json)."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.sync.client import ClientConnection, connect

from cleave_cli import render
from cleave_cli.errors import CleaveError, friendly, is_terminal
from coordinator.protocol import CLOSE_AUTH, ProtocolError, StatusReply, StatusRequest, decode, encode



def _ask(ws: ClientConnection, token: str) -> dict[str, Any]:
    ws.send(encode(StatusRequest(token)))
    try:
        reply = decode(ws.recv(timeout=10))
    except ConnectionClosed:
        if ws.close_code == CLOSE_AUTH:
            raise CleaveError("the coordinator refused the token", 2) from None
        raise CleaveError(f"the coordinator closed the connection ({ws.close_code} {ws.close_reason})") from None
    except TimeoutError:
        raise CleaveError("the coordinator did not answer within 10 s") from None
    if not isinstance(reply, StatusReply):
        raise ProtocolError(f"expected a status reply, got {reply.TYPE}")
    return reply.status


def fetch_status(url: str, token: str) -> dict[str, Any]:
    with _open(url) as ws:
        return _ask(ws, token)


def _open(url: str) -> ClientConnection:
    if not url.startswith(("ws://", "wss://")):
        raise CleaveError(f"coordinator URL must start with ws:// or wss://, got {url!r}", 2)
    try:
        return connect(url, compression=None, max_size=64 << 20, open_timeout=10, proxy=None)
    except InvalidURI as exc:
        raise CleaveError(f"bad coordinator URL: {exc}", 2) from None
    except (OSError, InvalidHandshake, TimeoutError) as exc:
        raise CleaveError(f"cannot reach a coordinator at {url}: {exc}") from None


@friendly
def status(
    token: Annotated[str, typer.Option("--token", help="The coordinator's join secret (required).")],
    url: Annotated[str, typer.Option("--url", help="Coordinator address.")] = "ws://127.0.0.1:8765",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (job, devices, tiles) and exit.")] = False,
    watch: Annotated[bool, typer.Option("--watch/--once", help="Keep the dashboard live (default on a terminal).")] = True,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes with --watch.")] = 1.0,
) -> None:
    """Show the job's step and loss, throughput, devices and the tile queue."""
    if not 0.1 <= interval <= 3600:
        raise CleaveError(f"--interval must be between 0.1 and 3600 s, got {interval}", 2)
    console = Console(highlight=False)
    if as_json:
        console.out(json.dumps(fetch_status(url, token), sort_keys=True))
        return
    if not (watch and is_terminal()):
        console.print(render.dashboard(fetch_status(url, token)))
        return
    with _open(url) as ws, Live(console=console, refresh_per_second=4) as live:
        while True:
            try:
                snapshot = _ask(ws, token)
            except CleaveError as exc:
                if exc.exit_code != 1:  # a refused token is an error, not the end of a job
                    raise
                live.console.print("the coordinator went away (job over?)", style="yellow")
                return
            live.update(render.dashboard(snapshot))
            if snapshot.get("job", {}).get("state") == "finished":
                return
            time.sleep(interval)
