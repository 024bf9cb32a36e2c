"""``cleave join``: lend this machine's compute to a coordinator."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.live import Live

from cleave_cli import render
from cleave_cli.errors import friendly, is_terminal
from client.runner import Worker, WorkerConfig, WorkerStats
from client.sysinfo import machine_name


class _Display:
    """A live status line on a terminal; state changes and a periodic summary in logs."""

    def __init__(self, console: Console, url: str, *, live: bool, quiet: bool) -> None:
        self.console, self.url, self.quiet = console, url, quiet
        self.live = Live(console=console, refresh_per_second=4, transient=False) if live and not quiet else None
        self._state = ""
        self._last = 0.0

    def __call__(self, stats: WorkerStats) -> None:
        if self.quiet:
            return
        line = render.client_line(stats, self.url)
        if self.live is not None:
            self.live.update(line)
            return
        quiet_states = {"working", "waiting for work"}
        changed = stats.state != self._state and not (stats.state in quiet_states and self._state in quiet_states)
        now = time.monotonic()
        if changed or now - self._last >= 10.0:
            self.console.print(line, soft_wrap=True)
            self._last = now
        self._state = stats.state

    def __enter__(self) -> "_Display":
        if self.live is not None:
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.stop()


@friendly
def join(
    url: Annotated[str, typer.Argument(help="Coordinator address, e.g. ws://192.168.1.10:8765")],
    token: Annotated[str, typer.Option("--token", help="The coordinator's join secret (it prints it at start).")],
    device: Annotated[str, typer.Option(help="Where tiles run: auto (CUDA, then MPS, then CPU), cpu, mps or cuda.")] = "auto",
    threads: Annotated[Optional[int], typer.Option(help="CPU threads for tile math. Default: torch's choice.")] = None,
    name: Annotated[Optional[str], typer.Option(help="Name shown on the coordinator's dashboard. Default: host name.")] = None,
    once: Annotated[bool, typer.Option("--once", help="Exit 0 when the coordinator reports the job finished.")] = False,
    slots: Annotated[int, typer.Option(help="Tiles kept in flight (prefetch), so compute never waits on the network.")] = 2,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No live display (for services).")] = False,
) -> None:
    """Join a coordinator: pull tiles, compute them with torch, send them back. Ctrl-C leaves gracefully."""
    cfg = WorkerConfig(url=url, token=token, name=name or machine_name(), device=device, threads=threads,
                       slots=slots, once=once)
    console = Console(highlight=False)
    with _Display(console, url, live=is_terminal(), quiet=quiet) as display:
        worker = Worker(cfg, on_update=display)
        code = asyncio.run(_run(worker))
    if not quiet:
        s = worker.stats
        console.print(f"left: {s.tiles:,} tiles computed, {s.flops / 1e9:,.1f} GFLOP, {s.rejected} rejected", highlight=False)
    raise typer.Exit(code)


async def _run(worker: Worker) -> int:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, worker.request_stop)
        except (NotImplementedError, RuntimeError):  # Windows: Ctrl-C arrives as KeyboardInterrupt
            pass
    return await worker.run()
