"""``cleave join``: lend this machine's compute to a coordinator, only while its owner allows."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.live import Live

from cleave.cli import options as opt
from cleave.cli import render
from cleave.cli.errors import friendly, is_terminal, stop_on_signals
from cleave.client.credentials import default_path as default_credentials
from cleave.client.idle import FileProbe, Reading, SystemProbe
from cleave.client.policy import Decision, PolicyConfig, default_config_path, load_config
from cleave.client.state import WorkerState
from cleave.client.sysinfo import machine_name
from cleave.wire.messages import MAX_NAME

if TYPE_CHECKING:  # the worker computes with torch: imported once there is work to do, not for --show-config
    from cleave.client.runner import Worker, WorkerStats


class _Display:
    """A live panel on a terminal; state changes and a periodic summary in logs."""

    def __init__(self, console: Console, url: str, *, live: bool, quiet: bool) -> None:
        self.console, self.url, self.quiet = console, url, quiet
        self.live = Live(console=console, refresh_per_second=4, transient=False) if live and not quiet else None
        self._state = ""
        self._last = 0.0

    def __call__(self, stats: WorkerStats) -> None:
        if self.quiet:
            return
        if self.live is not None:
            self.live.update(render.client_panel(stats, self.url))
            return
        quiet_states = {WorkerState.WORKING, WorkerState.WAITING}
        changed = stats.state != self._state and not (stats.state in quiet_states and self._state in quiet_states)
        now = time.monotonic()
        if changed or now - self._last >= 10.0:
            self.console.print(render.client_line(stats, self.url), soft_wrap=True)
            self._last = now
        self._state = stats.state

    def __enter__(self) -> _Display:
        if self.live is not None:
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.stop()


class _Explain:
    """--verbose: say what each probe reads (or why it cannot) and every change of decision."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._last: tuple[bool, str] | None = None
        self._notes_shown = False

    def __call__(self, decision: Decision, reading: Any) -> None:
        if isinstance(reading, Reading) and not self._notes_shown:
            self._notes_shown = True
            self.console.print(render.probe_report(reading), soft_wrap=True)
        key = (decision.run, decision.reason.split(";")[0].split(" resuming in")[0])
        if key != self._last:
            self._last = key
            verdict = "work" if decision.run else "pause"
            self.console.print(f"policy: {verdict}: {decision.reason}", style="dim", soft_wrap=True)


@friendly
def join(
    url: Annotated[str | None, typer.Argument(help="Coordinator address, e.g. ws://192.168.1.10:8765")] = None,
    token: Annotated[
        str | None,
        opt.secret_option(
            "--token",
            "The coordinator's join token: enrols this device once; later runs use the stored credential.",
            opt.Secret.JOIN_TOKEN,
        ),
    ] = None,
    token_file: opt.TokenFile = None,
    device: Annotated[
        str, typer.Option(help="Where tiles run: auto (CUDA, then MPS, then CPU), cpu, mps or cuda.")
    ] = "auto",
    threads: Annotated[
        int | None,
        typer.Option(help="CPU threads for tile math. Default: the config's max_threads, else torch's choice."),
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="Name shown on the coordinator's dashboard and leaderboard. Default: host name.")
    ] = None,
    once: Annotated[bool, typer.Option("--once", help="Exit 0 when the coordinator reports the job finished.")] = False,
    slots: Annotated[
        int, typer.Option(help="Tiles kept in flight (prefetch), so compute never waits on the network.")
    ] = 2,
    config: Annotated[
        Path | None,
        typer.Option("--config", help=f"Policy file (TOML). Default: {default_config_path()} if it exists."),
    ] = None,
    show_config: Annotated[
        bool, typer.Option("--show-config", help="Print the policy in force (defaults, file, flags) and exit.")
    ] = False,
    idle_minutes: Annotated[
        float | None, typer.Option("--idle-minutes", help="Work only after keyboard and mouse were idle this long.")
    ] = None,
    require_ac: Annotated[
        bool | None,
        typer.Option("--require-ac/--allow-battery", help="Work only on mains power (default), or on battery too."),
    ] = None,
    min_battery: Annotated[
        float | None, typer.Option("--min-battery", help="With --allow-battery: stop below this charge (percent).")
    ] = None,
    max_cpu: Annotated[
        float | None,
        typer.Option("--max-cpu", help="Pause while other programs use more than this share of the CPU (percent)."),
    ] = None,
    max_temp: Annotated[
        float | None, typer.Option("--max-temp", help="Pause above this temperature (degrees C, hottest sensor).")
    ] = None,
    hours: Annotated[str | None, typer.Option("--hours", help="Work only in these hours, e.g. 22:00-07:00.")] = None,
    max_memory_mb: Annotated[
        int | None, typer.Option("--max-memory-mb", help="Cap on memory for cached tile blocks (MB).")
    ] = None,
    always: Annotated[
        bool, typer.Option("--always", help="Ignore the idle, power, load and heat rules (dedicated machines, demos).")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Explain what each probe reads and every policy decision.")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No live display (for services).")] = False,
    cafile: opt.CaFile = None,
    insecure: opt.Insecure = False,
    credentials: Annotated[
        Path | None,
        typer.Option(
            "--credentials", help=f"File of this machine's device credentials. Default: {default_credentials()}."
        ),
    ] = None,
    new_identity: Annotated[
        bool,
        typer.Option(
            "--new-identity", help="Enrol again with the join token as a new device, replacing the stored credential."
        ),
    ] = False,
    grid_gco2_kwh: opt.GridOpt = None,
    powercap: Annotated[
        Path | None,
        typer.Option("--powercap", hidden=True, help="Testing: read RAPL counters from this folder (a fake powercap)."),
    ] = None,
    energy_every: Annotated[
        float | None, typer.Option("--energy-every", hidden=True, help="Testing: seconds between energy reports.")
    ] = None,
    probe_file: Annotated[
        Path | None, typer.Option("--probe-file", hidden=True, help="Testing: read probe values from this JSON file.")
    ] = None,
) -> None:
    """Join a coordinator: pull tiles, compute them with torch, send them back, only while the
    machine is idle and plugged in (by default). Ctrl-C leaves gracefully."""
    overrides: dict[str, Any] = {
        "idle_minutes": idle_minutes,
        "require_ac": require_ac,
        "min_battery": min_battery,
        "max_other_cpu": max_cpu,
        "max_temp": max_temp,
        "hours": hours,
        "max_memory_mb": max_memory_mb,
        "max_threads": threads,
    }
    if always:
        rules = PolicyConfig.always()
        overrides.update(
            {
                k: getattr(rules, k)
                for k in ("idle_minutes", "require_ac", "min_battery", "max_other_cpu", "max_temp", "resume_after")
            },
            hours="",
        )
    policy, used = load_config(config, overrides)
    console = Console(highlight=False)
    if show_config:
        source = (
            f"# policy from {used} and flags" if used else f"# defaults and flags ({default_config_path()} not found)"
        )
        console.out(f"{source}\n{policy.to_toml()}", highlight=False)
        return
    if url is None:
        raise typer.BadParameter("URL is required (unless --show-config)")
    token = opt.read_secret(token, token_file, "--token", opt.Secret.JOIN_TOKEN)
    if new_identity and not token:
        raise typer.BadParameter("--new-identity needs the join token (CLEAVE_TOKEN, --token-file or --token)")
    from cleave.client.runner import Worker, WorkerConfig

    cfg = WorkerConfig(
        url=url,
        token=token or "",
        name=name or machine_name()[:MAX_NAME],
        device=device,
        threads=threads,
        slots=slots,
        once=once,
        policy=policy,
        cafile=str(cafile) if cafile else None,
        insecure=insecure,
        credentials=credentials,
        new_identity=new_identity,
        grid_gco2_kwh=grid_gco2_kwh or 0.0,
        powercap=powercap,
        **({} if energy_every is None else {"energy_every": energy_every}),
    )
    probe = FileProbe(probe_file, SystemProbe()) if probe_file is not None else SystemProbe()
    with _Display(console, url, live=is_terminal(), quiet=quiet) as display:
        worker = Worker(cfg, probe=probe, on_update=display, on_decision=_Explain(console) if verbose else None)
        code = asyncio.run(_run(worker))
    if not quiet:
        s = worker.stats
        who = f"device #{s.identity}" if s.identity else repr(cfg.name)
        console.print(
            f"left: {s.tiles:,} tiles computed, {s.credit_gflop:,.2f} GFLOP verified to your credit "
            f"({s.credit_total_gflop:,.2f} in total for {who}), {s.rejected} rejected"
            + (f"; {render.joules(s.energy_j)} used while serving ({s.energy_source})" if s.energy_source else ""),
            highlight=False,
        )
    raise typer.Exit(code)


async def _run(worker: Worker) -> int:
    stop_on_signals(worker.request_stop)
    return await worker.run()
