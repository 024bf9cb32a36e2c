"""Rich renderables for every screen Cleave shows. Nothing here prints: callers hand the
result to a Console (tests render into ``Console(file=io.StringIO())``).

Strings that come from peers (device names, reasons, job names) go in as ``Text``, never as
markup: a volunteer named ``[/bold]`` must show as that, not break the dashboard."""

from __future__ import annotations

import datetime as dt
import shlex
from collections.abc import Sequence
from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from cleave.client.state import WorkerState
from cleave.wire.codes import DeviceView, JobPhase


def _num(value: float | None, fmt: str = "{:.4f}", missing: str = "-") -> str:
    return missing if value is None else fmt.format(value)


def _mb(value: float) -> str:
    return f"{value:,.1f} MB"


def joules(value: float) -> str:
    """Energy in the unit that reads best: J, kJ, MJ, then kWh."""
    if value >= 3.6e6:
        return f"{value / 3.6e6:,.2f} kWh"
    if value >= 1e6:
        return f"{value / 1e6:,.2f} MJ"
    if value >= 1e3:
        return f"{value / 1e3:,.1f} kJ"
    return f"{value:,.0f} J"


def _mix(sources: dict[str, float] | None) -> str:
    total = sum((sources or {}).values())
    if not total:
        return "none yet"
    return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted((sources or {}).items()))


def energy_line(energy: dict[str, Any] | None) -> str:
    """The job's energy (``status["energy"]``) in one line."""
    if not energy or not energy.get("joules"):
        return "no energy reported yet"
    line = (
        f"{joules(energy['joules'])} ({joules(energy.get('devices_j', 0))} devices: "
        f"{_mix(energy.get('devices_sources'))}; {joules(energy.get('coordinator_j', 0))} coordinator: "
        f"{_mix(energy.get('coordinator_sources'))}), {_num(energy.get('j_per_gflop'), '{:.3f}')} J per verified "
        f"GFLOP, {energy.get('gco2', 0):,.1f} g CO2 at {energy.get('grid_gco2_kwh', 0):g} g/kWh"
    )
    if "increment_j" in energy:  # over machines on anyway: devices' draw less their idle
        line += f"; increment {joules(energy['increment_j'])}"
    if energy.get("flagged"):
        line += f"; {energy['flagged']:,} device claims capped"
    return line


def held_out(job: dict[str, Any], form: str) -> str:
    """The job's last held-out loss in ``form`` (``{loss}``, ``{step}``); "" before the first."""
    if job.get("val_step") is None:
        return ""
    return form.format(loss=_num(job.get("val_loss")), step=f"{job['val_step']:,}")


def step_line(
    step: int,
    steps: int,
    loss: float,
    seconds: float,
    status: dict[str, Any] | None,
    tokens_per_s: float = 0.0,
    *,
    show_step: bool = True,
    val_loss: float | None = None,
) -> Text:
    """One line per step; ``status`` is the coordinator's snapshot, or None for a local run;
    ``val_loss``: the held-out loss, on a step that evaluated one."""
    text = Text()
    if show_step:
        text.append(f"step {step:>{len(str(steps))}}/{steps}  ", style="bold")
    text.append(f"loss {loss:.4f}", style="cyan")
    if val_loss is not None:
        text.append(f"  held-out {val_loss:.4f}", style="magenta")
    text.append(f"  {seconds * 1000:7.1f} ms")
    if status is None:
        text.append(f"  {tokens_per_s:,.0f} tok/s  (local torch)")
        return text
    tiles = status.get("tiles", {})
    devices = sum(1 for d in status.get("devices", []) if d.get("state") in (DeviceView.IDLE, DeviceView.WORKING))
    text.append(f"  {status.get('job', {}).get('tokens_per_s', 0):,.0f} tok/s")
    text.append(f"  {devices} device{'s' if devices != 1 else ''}")
    text.append(f"  tiles {tiles.get('verified', 0):,} verified")
    if tiles.get("rejected"):
        text.append(f", {tiles['rejected']:,} rejected", style="bold red")
    return text


def listening(info: Any) -> Text:
    """The coordinator's banner: where it listens, and the commands to join and to watch it."""
    text = Text()
    text.append("cleave coordinator listening on ", style="bold")
    text.append(info.url, style="bold green")
    insecure = " --insecure" if info.exposed else ""
    text.append("\njoin with: ")
    join_token = shlex.quote(info.join_token) if info.join_token is not None else "<the join token>"
    # The tokens by environment: other users on the volunteer's machine can read a command line.
    text.append(f"CLEAVE_TOKEN={join_token} cleave join {info.join_url}{insecure}", style="yellow")
    text.append("\nwatch with: ")
    operator = shlex.quote(info.operator_token) if info.operator_token is not None else "<the operator token>"
    text.append(f"CLEAVE_OPERATOR_TOKEN={operator} cleave status --url {info.join_url}{insecure}", style="yellow")
    notes = []
    if "join" in info.generated:
        notes.append("join token generated (set CLEAVE_TOKEN or --token-file to choose one)")
    elif info.join_token is None:
        notes.append("join token kept from the database")
    if "operator" in info.generated:
        notes.append("operator token generated (set CLEAVE_OPERATOR_TOKEN or --operator-token-file to choose one)")
    elif info.operator_token is None:
        notes.append("operator token kept from the database")
    if notes:
        text.append(f"\n({'; '.join(notes)}; `cleave coordinator token rotate` replaces one)", style="dim")
    if info.exposed:
        text.append(
            "\nwarning: unencrypted ws:// on a network address: tokens and blocks travel in clear. "
            "Serve wss:// with --certfile and --keyfile.",
            style="bold yellow",
        )
    return text


def job_summary(status: dict[str, Any] | None) -> str:
    """One line for a job that is over: its final numbers, or, when the coordinator closed before
    ``cleave status`` saw the finished state, where it last saw the job."""
    job = (status or {}).get("job") or {}
    if not job:
        return "the job is over: the coordinator closed the connection as it finished"
    tiles = (status or {}).get("tiles") or {}
    counts = (status or {}).get("device_counts") or {}
    devices = sum(n for state, n in counts.items() if state != "connected")  # every one, not the listed
    steps, loss = f"{job.get('step') or 0:,}/{job.get('steps') or 0:,} steps", _num(job.get("loss"))
    loss += held_out(job, ", held-out {loss} (step {step})")
    work = (
        f"{tiles.get('verified', 0):,} tiles verified, {tiles.get('rejected', 0):,} rejected, "
        f"{tiles.get('lost', 0):,} lost, on {devices:,} device{'s' if devices != 1 else ''}"
    )
    if job.get("state") == JobPhase.FINISHED:
        return f"job finished: {steps}, final loss {loss}; {work}"
    return f"the job finished and the coordinator left; last seen at {steps}, loss {loss}; {work}"


def dashboard(status: dict[str, Any], rank_by: str = "gflop") -> Group:
    """``cleave status``: the job, its tiles and its devices."""
    job = status.get("job", {})
    tiles = status.get("tiles", {})
    steps = job.get("steps") or 0
    step = job.get("step") or 0
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("job", Text(f"{job.get('name', '')}  [{job.get('state', '')}]"))
    timing = ""
    if job.get("elapsed_s") is not None:
        timing = f"  {_duration(job['elapsed_s'])} elapsed"
        timing += f", about {_duration(job['eta_s'])} left" if job.get("eta_s") is not None else ""
    summary.add_row("step", f"{step}/{steps}" + (f"  ({100 * step / steps:.0f}%)" if steps else "") + timing)
    summary.add_row("loss", _num(job.get("loss")))
    if job.get("val_step") is not None:
        summary.add_row("held-out loss", held_out(job, "{loss}  (evaluated after step {step})"))
    summary.add_row("throughput", f"{job.get('tokens_per_s', 0):,.0f} tokens/s")
    share = job.get("gemm_share")
    if isinstance(share, dict) and isinstance(share.get("share"), (int, float)):
        summary.add_row("volunteers", f"can take {share['share']:.1%} of the model's matrix work (the planner decides)")
    summary.add_row(
        "tiles",
        f"{tiles.get('verified', 0):,} verified, {tiles.get('leased', 0):,} leased, "
        f"{tiles.get('queued', 0):,} queued, {tiles.get('rejected', 0):,} rejected",
    )
    summary.add_row(
        "faults",
        f"{tiles.get('requeued', 0):,} re-queued, {tiles.get('expired', 0):,} expired, "
        f"{tiles.get('speculative', 0):,} speculative, {tiles.get('cancelled', 0):,} cancelled, "
        f"{tiles.get('lost', 0):,} lost, {tiles.get('revoked', 0):,} taken back",
    )
    lost = status.get("lost_reasons") or {}
    if lost:
        why = ", ".join(f"{reason or 'no reason given'}: {n:,}" for reason, n in lost.items())
        summary.add_row("lost because", Text(why))
    summary.add_row("queue depth", str(status.get("queue_depth", tiles.get("queued", 0))))
    plan = status.get("plan")
    if plan:
        predicted, measured = plan.get("predicted_step_s"), plan.get("measured_step_s")
        line = (
            f"{plan.get('planner', '?')} planner: step {_num(predicted, '{:.3f} s')} predicted, "
            f"{_num(measured, '{:.3f} s')} measured"
        )
        if plan.get("predicted_home_step_s") is not None:
            line += f", {plan['predicted_home_step_s']:.3f} s predicted on the coordinator alone"
        kinds = plan.get("partitions") or {}
        if kinds:
            line += (
                "  (last step's GEMMs, by how each was cut: "
                + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
                + ")"
            )
        summary.add_row("plan", line)
    traffic = status.get("traffic")
    if traffic:
        summary.add_row("traffic", f"{_mb(traffic.get('mb_down', 0))} down, {_mb(traffic.get('mb_up', 0))} up")
    if "energy" in status:
        summary.add_row("energy", energy_line(status["energy"]))
    devices = Table(title="devices", expand=True)
    for col, justify in [
        ("name", "left"),
        ("state", "left"),
        ("device", "left"),
        ("GFLOP/s", "right"),
        ("Mbit/s ↓/↑", "right"),
        ("tiles", "right"),
        ("rejected", "right"),
        ("lost", "right"),
        ("reliability", "right"),
        ("verified GFLOP", "right"),
    ]:
        devices.add_column(col, justify=justify)  # type: ignore[arg-type]
    style = {
        DeviceView.WORKING: "green",
        DeviceView.IDLE: "cyan",
        DeviceView.PAUSED: "yellow",
        DeviceView.STANDBY: "cyan",
        DeviceView.OFFLINE: "dim",
        DeviceView.BANNED: "bold red",
        DeviceView.REVOKED: "red",
    }
    for d in status.get("devices", []):
        state = d.get("state", "")
        busy = state in (DeviceView.WORKING, DeviceView.IDLE)
        reason = f" ({d['reason']})" if d.get("reason") and not busy else ""  # paused: why
        devices.add_row(
            Text(str(d.get("label") or d.get("name", ""))),
            Text(state + reason, style=style.get(state, "")),
            Text(str(d.get("device", ""))),
            f"{d.get('gflops', 0):.1f}",
            _links(d.get("profile")),
            f"{d.get('tiles_done', 0):,}",
            Text(f"{d.get('tiles_rejected', 0):,}", style="red" if d.get("tiles_rejected") else ""),
            f"{d.get('tiles_lost', 0):,}",
            Text(reliability(d), style="yellow" if d.get("reliability", 1.0) < 0.9 else ""),
            f"{d.get('gflop_verified', 0):,.2f}",
        )
    if not status.get("devices"):
        devices.add_row("(no devices yet)", *[""] * 9)
    counts = status.get("device_counts") or {}
    listed = len(status.get("devices", []))
    total = sum(v for k, v in counts.items() if k != "connected")
    if total > listed:
        devices.caption = f"{listed} of {total} devices listed: " + ", ".join(
            f"{v:,} {k}" for k, v in sorted(counts.items()) if k != "connected"
        )
    parts: list[Any] = [Panel(summary, title="cleave", border_style="blue")]
    if status.get("tier"):
        parts.append(tier_table(status["tier"]))
    parts.append(devices)
    efficient = rank_by == "efficiency"
    leaders = status.get("leaderboard_efficiency" if efficient else "leaderboard") or []
    if leaders:
        title = "verified GFLOP per joule" if efficient else "verified work"
        board = Table(title=f"leaderboard: {title} by device", expand=True)
        board.add_column("#", justify="right")
        board.add_column("device")
        board.add_column("verified GFLOP", justify="right")
        board.add_column("tiles", justify="right")
        board.add_column("energy", justify="right")
        board.add_column("GFLOP/J", justify="right")
        for rank, row in enumerate(leaders, start=1):
            who = Text(str(row.get("label") or row.get("name", "")))
            board.add_row(
                str(rank),
                who,
                f"{row.get('gflop', 0):,.2f}",
                f"{row.get('tiles', 0):,}",
                joules(row["joules"]) if row.get("joules") else "-",
                _num(row.get("gflop_per_j"), "{:,.2f}"),
            )
        parts.append(board)
    return Group(*parts)


_HEALTH_STYLE = {"alive": "green", "self": "bold green", "silent": "yellow", "lost": "bold red"}


def tier_table(tier: dict[str, Any]) -> Table:
    """A rank's view of its tier (``status["tier"]``): a row per rank, this one marked."""
    table = Table(title=f"tier: rank {tier['rank']} of {tier['world']} (this one marked *)", expand=True)
    for col, justify in [
        ("rank", "right"),
        ("health", "left"),
        ("state", "left"),
        ("step", "right"),
        ("devices", "right"),
        ("tiles/s", "right"),
        ("pool GFLOP/s", "right"),
        ("URL", "left"),
    ]:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in tier.get("ranks", []):
        health = r.get("health", "")
        if health in ("silent", "lost"):
            health += f" {r.get('silent_s', 0):.0f} s"
        figures = (
            [
                Text(str(r.get("state", ""))),
                f"{r['step']:,}",
                f"{r['devices']:,}",
                f"{r['tiles_per_s']:,.1f}",
                f"{r['gflops']:,.1f}",
                Text(str(r.get("url", ""))),
            ]
            if "step" in r
            else [Text(r.get("note") or "no status yet", style="red" if r.get("note") else "dim"), "", "", "", "", ""]
        )
        marker = "*" if r.get("rank") == tier.get("rank") else ""
        table.add_row(f"{marker}{r.get('rank')}", Text(health, style=_HEALTH_STYLE.get(r.get("health"), "")), *figures)
    return table


_STATE_STYLE = {
    WorkerState.WORKING: "bold green",
    WorkerState.PAUSED: "bold yellow",
    WorkerState.STANDBY: "cyan",
    WorkerState.RECONNECTING: "bold red",
    WorkerState.CONNECTING: "bold",
}


def reliability(device: dict[str, Any]) -> str:
    """Share of a device's finished tiles that came back verified. Never "100.0%" once one was
    rejected, lost or taken back: rounding must not hide a failure."""
    share = 100 * device.get("reliability", 1.0)
    failed = sum(device.get(k) or 0 for k in ("tiles_rejected", "tiles_lost", "tiles_revoked"))
    return f"{min(share, 99.9):.1f}%" if failed and share >= 99.95 else f"{share:.1f}%"


def _links(profile: dict[str, Any] | None) -> str:
    """Measured downlink/uplink in Mbit/s; "-" for one not measured yet (or too fast to resolve)."""
    if not profile:
        return "-"

    def mbps(value: float | None) -> str:
        return "-" if value is None else f"{value:,.0f}"

    return f"{mbps(profile.get('down_mbps'))}/{mbps(profile.get('up_mbps'))}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h {rest // 60:02d}m" if hours else f"{rest // 60}m {rest % 60:02d}s"


def client_panel(stats: Any, url: str) -> Panel:
    """The live panel of ``cleave join`` on a terminal."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    state = Text(stats.state, style=_STATE_STYLE.get(stats.state, "bold"))
    if stats.reason:
        state.append(f"  ({stats.reason})", style="yellow" if stats.state == WorkerState.PAUSED else "dim")
    grid.add_row("state", state)
    grid.add_row("coordinator", Text(f"{url}" + (f"  job: {stats.job}" if stats.job else "")))
    bench = f"{stats.benchmark_gflops:,.1f} GFLOP/s benchmark" + (" (cached)" if stats.benchmark_cached else "")
    grid.add_row("device", Text(f"{stats.device}  {bench}"))
    tiles = Text(f"{stats.tiles:,} done")
    if stats.rejected:
        tiles.append(f", {stats.rejected} rejected", style="red")
    grid.add_row("tiles", tiles)
    grid.add_row("speed", f"{stats.gflops:,.1f} GFLOP/s while computing")
    grid.add_row(
        "credit",
        f"{stats.credit_gflop:,.2f} GFLOP verified (this session), "
        f"{stats.credit_total_gflop:,.2f} in total for this device",
    )
    grid.add_row("traffic", f"{stats.bytes_down / 1e6:,.1f} MB down, {stats.bytes_up / 1e6:,.1f} MB up")
    energy = getattr(stats, "energy_j", 0.0)
    grid.add_row(
        "energy",
        f"{joules(energy)} while serving ({stats.energy_source})"
        + (f", {stats.credit_gflop / energy:,.2f} verified GFLOP per joule" if energy and stats.credit_gflop else "")
        if stats.energy_source
        else "measured from the first report (every 30 s, with results)",
    )
    grid.add_row("uptime", _duration(stats.uptime))
    if stats.last_error and stats.state in (WorkerState.RECONNECTING, WorkerState.CONNECTING):
        grid.add_row("last error", Text(stats.last_error, style="yellow"))
    return Panel(grid, title="cleave join", subtitle="Ctrl-C leaves (tiles go back at once)", border_style="blue")


def probe_report(reading: Any) -> Text:
    """What ``cleave join --verbose`` can see of the machine, and why not where it cannot."""

    def show(value: Any, fmt: str) -> str:
        return "unknown" if value is None else fmt.format(value)

    text = Text("probes: ", style="bold")
    text.append(f"power {show(reading.on_ac, '{}').replace('True', 'on AC').replace('False', 'on battery')}, ")
    text.append(f"battery {show(reading.battery_percent, '{:.0f}%')}, ")
    text.append(f"other programs' CPU {show(reading.other_cpu_percent, '{:.0f}%')}, ")
    text.append(f"input idle {show(reading.user_idle_seconds, '{:.0f} s')}, ")
    text.append(f"hottest sensor {show(reading.temperature_c, '{:.0f} C')}")
    for probe, why in sorted(reading.notes.items()):
        text.append(f"\n  {probe}: {why}", style="dim")
    return text


def client_line(stats: Any, url: str) -> Text:
    """The log line of ``cleave join`` when not on a terminal."""
    text = Text()
    text.append(f"{stats.state:<16}", style=_STATE_STYLE.get(stats.state, "bold"))
    if stats.reason and stats.state in (WorkerState.PAUSED, WorkerState.STANDBY):
        text.append(f" ({stats.reason})", style="yellow" if stats.state == WorkerState.PAUSED else "dim")
    text.append(f" tiles {stats.tiles:,}")
    if stats.rejected:
        text.append(f" ({stats.rejected} rejected)", style="red")
    text.append(f"  {stats.gflops:6.1f} GFLOP/s")
    text.append(f"  {stats.bytes_down / 1e6:,.1f} MB in / {stats.bytes_up / 1e6:,.1f} MB out")
    if getattr(stats, "energy_source", ""):
        text.append(f"  {joules(stats.energy_j)} ({stats.energy_source})")
    text.append(f"  {stats.device}  {url}", style="dim")
    if stats.last_error and stats.state in (WorkerState.RECONNECTING, WorkerState.CONNECTING):
        text.append(f"  {stats.last_error}", style="yellow")
    return text


def benchmark_table(result: Any) -> Table:
    """``cleave benchmark``: GEMM speed per dtype and shape, memory, and the link."""
    table = Table(title=f"cleave benchmark: {result.device}, {result.threads} threads, torch {result.torch}")
    table.add_column("what")
    table.add_column("figure", justify="right")
    for g in result.gemm:
        figure = f"{g.gflops:,.1f} GFLOP/s" if g.gflops else Text("not supported", style="dim")
        table.add_row(f"GEMM {g.dtype} {g.size}x{g.size}x{g.size}", figure)
    table.add_row("usable memory", f"{result.memory_bytes / 2**30:,.1f} GiB")
    if result.link is not None:
        table.add_row("round trip to coordinator", f"{result.link.rtt_ms:,.2f} ms")
        table.add_row("download from coordinator", f"{result.link.down_mb_s:,.1f} MB/s")
        table.add_row("upload to coordinator", f"{result.link.up_mb_s:,.1f} MB/s")
    return table


def identities(rows: Sequence[Any]) -> Table:
    """``cleave coordinator devices list``: enrolled devices, newest first."""
    table = Table(title="enrolled devices", expand=True)
    for col, justify in [
        ("#", "right"),
        ("name", "left"),
        ("state", "left"),
        ("enrolled", "left"),
        ("last seen", "left"),
        ("tiles done", "right"),
        ("rejected", "right"),
        ("lost", "right"),
        ("taken back", "right"),
        ("reliability", "right"),
        ("verified GFLOP", "right"),
        ("reason", "left"),
    ]:
        table.add_column(col, justify=justify, no_wrap=col != "reason")  # type: ignore[arg-type]
    style = {"active": "green", "banned": "bold red", "revoked": "red"}
    for r in rows:
        table.add_row(
            str(r.id),
            Text(r.name),
            Text(r.state, style=style.get(r.state, "")),
            _when(r.created_at),
            _when(r.last_seen),
            f"{r.tiles_done:,}",
            f"{r.tiles_rejected:,}",
            f"{r.tiles_lost:,}",
            f"{r.tiles_revoked:,}",
            f"{100 * r.reliability:.1f}%",
            f"{r.gflop_verified:,.2f}",
            Text(r.reason),
        )
    if not rows:
        table.add_row("", "(no device has enrolled yet)", *[""] * 10)
    return table


def _when(epoch: float | None) -> str:
    if not epoch:
        return ""
    return dt.datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M")


def comparison(rows: Sequence[tuple[str, float, float]], max_rel_diff: float, tolerance: float) -> Table:
    """Final losses side by side: distributed run against the local baseline."""
    table = Table(title="distributed vs local baseline")
    table.add_column("")
    table.add_column("cleave (tiles on clients)", justify="right")
    table.add_column("local torch", justify="right")
    for label, dist, local in rows:
        table.add_row(
            label,
            f"{dist:.6f}" if isinstance(dist, float) else str(dist),
            f"{local:.6f}" if isinstance(local, float) else str(local),
        )
    verdict = Text(f"max relative loss difference over all steps: {max_rel_diff:.2e} ", style="bold")
    verdict.append(
        "(match)" if max_rel_diff <= tolerance else "(MISMATCH)",
        style="bold green" if max_rel_diff <= tolerance else "bold red",
    )
    table.caption = verdict.plain
    return table


# --------------------------------------------------------------------------- cleave plan


def _seconds(value: float | None) -> str:
    if value is None:
        return "never"
    if value == 0:
        return "0 s"
    for limit, scale, unit in ((1e-3, 1e6, "µs"), (1.0, 1e3, "ms"), (120.0, 1.0, "s"), (7200.0, 1 / 60, "min")):
        if value < limit:
            return f"{value * scale:.3g} {unit}"
    return f"{value / 3600:,.3g} h"


def _bytes(value: float, binary: bool = False) -> str:
    """Traffic in decimal units (a link's Mbit/s are decimal), memory in binary ones."""
    base, units = (
        (1024.0, ("B", "KiB", "MiB", "GiB", "TiB", "PiB")) if binary else (1000.0, ("B", "kB", "MB", "GB", "TB", "PB"))
    )
    for unit in units[:-1]:
        if abs(value) < base:
            return f"{value:.3g} {unit}" if unit != "B" else f"{value:.0f} B"
        value /= base
    return f"{value:,.3g} {units[-1]}"


def _flops(value: float) -> str:
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if value >= scale:
            return f"{value / scale:,.3g} {unit}"
    return f"{value / 1e6:.3g} MFLOP/s"


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:,.3g}x"


def plan_report(report: dict[str, Any]) -> Group:
    """``cleave plan``: the step's prediction, each GEMM's partition, and each class's load.
    ``report`` is the ``--json`` object (coordinator/whatif/report.py), so both always agree."""
    model, fleet, ps, step = report["model"], report["fleet"], report["ps"], report["step"]
    dtype = report["dtype"]
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row(
        "model",
        Text(
            f"{model['name']}: {model['params'] / 1e6:,.1f}M parameters, "
            f"{report['batch_size']:,} x {report['seq_len']:,} = {report['tokens']:,} tokens "
            f"per step, {dtype}"
        ),
    )
    summary.add_row(
        "fleet",
        Text(
            f"{fleet['spec']}: {fleet['devices']:,} devices in {len(fleet['classes'])} "
            f"classes, {_flops(fleet['gflops'] * 1e9)} in {dtype}"
        ),
    )
    summary.add_row(
        "parameter server",
        f"{ps.get('preset', 'server')}: {ps['link_gbps']:g} Gbit/s each way, {_flops(ps['gflops'] * 1e9)} in "
        f"{dtype}, verifies at {_flops(ps['verify_gflops'] * 1e9)}, memory {_bytes(ps['memory_bw'])}/s",
    )
    tier = report.get("tier")
    if report.get("coordinators", 1) > 1 and tier is not None:
        summary.add_row(
            "tier",
            f"{report['coordinators']} coordinators on {tier['link_gbps']:g} Gbit/s each way: the slowest trains "
            f"{tier['batch_per_rank']:,} sequences on {tier['devices_per_rank']:,} devices, its collectives "
            f"{_seconds(tier['seconds'])} a step",
        )
    summary.add_row(
        "step",
        Text(
            f"{_seconds(step['seconds'])} predicted, {_rate(report['tokens'] / step['seconds'])} tokens/s",
            style="bold green",
        ),
    )
    summary.add_row(
        "",
        f"GEMMs {_seconds(step['gemm_seconds'])} + parameter server's own work "
        f"{_seconds(step['ps_other_seconds'])} (attention {_seconds(step['attention_seconds'])}, "
        f"AdamW {_seconds(step['optimizer_seconds'])}"
        + (f", the tier's collectives {_seconds(step['tier_seconds'])})" if step.get("tier_seconds") else ")"),
    )
    bound = step["seconds_by_bound"]
    summary.add_row(
        "GEMM time by limit",
        ", ".join(
            f"{name} {_seconds(bound[key])}"
            for key, name in (
                ("compute", "compute"),
                ("down", "downlink"),
                ("up", "uplink"),
                ("ps", "PS work"),
                ("loop", "PS event loop"),
            )
            if key in bound
        ),
    )
    summary.add_row(
        "busiest stage sums",
        f"compute {_seconds(step['compute_seconds'])}, downlink "
        f"{_seconds(step['down_seconds'])}, uplink {_seconds(step['up_seconds'])}, "
        f"PS work {_seconds(step['ps_seconds'])} (stages overlap within a GEMM)",
    )
    floor = step["egress_floor_bytes"]
    summary.add_row(
        "PS traffic",
        f"egress {_bytes(step['egress_bytes'])} (floor for these partitions "
        f"{_bytes(floor)}"
        + (f", {step['egress_bytes'] / floor:.2f}x" if floor else "")
        + f"), ingress {_bytes(step['ingress_bytes'])}",
    )
    busy = (
        f"at most {step['devices']:,} devices busy at once"
        if step["devices"]
        else "no device used: the PS computes every GEMM itself"
    )
    summary.add_row(
        "fleet utilisation",
        f"{100 * step['fleet_utilisation']:.3g}% ({100 * step['utilisation']:.3g}% "
        f"counting GEMMs the PS keeps); {busy}",
    )
    verdict = Text(f"{_seconds(step['baseline_seconds'])} per step")
    if step["speedup"] is not None:
        verdict.append(f"  ->  {_times(step['speedup'])} faster with this plan", style="bold")
    summary.add_row("round-robin tiles", verdict)

    gemms = Table(title="GEMMs (seconds each; a step runs each x times)", title_justify="left")
    for col, justify in [
        ("GEMM", "left"),
        ("x", "right"),
        ("m x n x k", "right"),
        ("partition", "left"),
        ("grid r x c x k", "right"),
        ("devices", "right"),
        ("seconds", "right"),
        ("bound", "left"),
        ("egress", "right"),
        ("floor", "right"),
        ("round-robin", "right"),
    ]:
        gemms.add_column(col, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for g in report["gemms"]:
        gemms.add_row(
            Text(f"{g['layer']}.{g['kind']}"),
            f"{g['count']:,}",
            f"{g['m']}x{g['n']}x{g['k']}",
            g["partition"],
            "x".join(str(v) for v in g["grid"]),
            f"{g['devices']:,}",
            _seconds(g["seconds"]),
            g["bound"],
            _bytes(g["egress_bytes"]),
            _bytes(g["egress_floor_bytes"]),
            _seconds(g["baseline_seconds"]),
        )

    classes = Table(title="device classes", title_justify="left")
    for col in (
        "class",
        "devices",
        "used (most)",
        f"GFLOP/s {dtype}",
        "down / up Mbit/s",
        "RTT",
        "memory budget",
        "busiest device needs",
    ):
        classes.add_column(col, justify="left" if col == "class" else "right", no_wrap=True)
    usage = {c["name"]: c for c in report["classes"]}
    for c in fleet["classes"]:
        use = usage.get(c["name"], {})
        classes.add_row(
            Text(c["name"]),
            f"{c['count']:,}",
            f"{use.get('used', 0):,}",
            _rate(c["gflops"]),
            f"{c['down'] * 8 / 1e6:,.4g} / {c['up'] * 8 / 1e6:,.4g}",
            _seconds(c["rtt"]),
            _bytes(c["memory"], binary=True),
            _bytes(use.get("memory_bytes", 0), binary=True) if use.get("used") else "-",
        )
    return Group(Panel(summary, title="cleave plan", border_style="blue", expand=False), gemms, classes)


# --------------------------------------------------------------------------- cleave simulate


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _sim_run(report: dict[str, Any], run: dict[str, Any]) -> Group:
    """One device count: Cleave's simulated step and its breakdown, beside the baselines."""
    c, dtfm, cloud, speed = run["cleave"], run["dtfm"], run["cloud"], run["speedup"]
    title = f"{run['devices']:,} devices"
    if report.get("coordinators", 1) > 1:
        title += (
            f", {report['coordinators']} coordinators on {report['tier_link_gbps']:g} Gbit/s (the slowest serves "
            f"{c['devices_per_rank']:,} devices; its collectives {_seconds(c['tier_s'])} a step)"
        )
    head = Table(title=title, title_justify="left", show_header=True, expand=False)
    for name in ("", "seconds per batch", "tokens/s", "binds", "recovery after a crash"):
        head.add_column(name, justify="right" if name else "left")
    head.add_row(
        "Cleave (simulated)",
        _seconds(c["step_s"]),
        _rate(c["tokens_per_s"] or 0.0),
        c["bound"],
        _seconds(c["recovery_s"]) if c["recovery_s"] is not None else "no work lost",
    )
    dtfm_row = (
        "DTFM-style pipeline",
        _seconds(dtfm["step_s"]),
        "-" if dtfm["step_s"] is None else _rate(report["tokens"] / dtfm["step_s"]),
        dtfm["bound"] if dtfm["step_s"] is not None else Text(dtfm["why"] or "infeasible"),
        _seconds(dtfm["recovery_s"]),
    )
    head.add_row(*dtfm_row)
    head.add_row(
        f"cloud ({cloud['gpus']}x {cloud['gpu']}, {cloud['utilisation']:.0%} MFU)",
        _seconds(cloud["step_s"]),
        _rate(report["tokens"] / cloud["step_s"]),
        "compute" if cloud["fits"] else "memory",
        "-",
    )
    busy = Table(title="where the step goes (busiest device; PS totals)", title_justify="left")
    busy.add_column("resource")
    busy.add_column("busy", justify="right")
    busy.add_column("share of the step", justify="right")
    for key, label in (
        ("compute", "device compute"),
        ("downlink", "device downlink"),
        ("uplink", "device uplink"),
        ("ps_egress", "PS egress"),
        ("ps_ingress", "PS ingress"),
        ("relay_egress", "relay egress (each)"),
        ("ps_cpu", "PS CPU"),
        ("ps_loop", "PS event loop"),
    ):
        if key == "relay_egress" and not c["busy_s"].get(key):
            continue  # no relays
        if key not in c["busy_s"]:
            continue  # a report from before the loop was charged
        busy.add_row(label, _seconds(c["busy_s"][key]), _share(c["utilisation"][key]))
    busy.add_row(
        "stalls from churn", _seconds(c["stall_s"]), _share(c["stall_s"] / c["step_s"] if c["step_s"] else None)
    )
    cpu = ", ".join(f"{k.replace('_', ' ')} {_seconds(v)}" for k, v in c["ps_cpu_s"].items() if v)
    b = c["bytes"]
    lines = Text()
    lines.append(f"PS CPU: {cpu or 'idle'}\n")
    shares = c.get("coordinator_share") or {}
    if shares:
        each = ", ".join(f"{k} {_share(v)}" for k, v in shares.items())
        lines.append(f"coordinator busy (share of the step): {each}; binds: {c['coordinator_busiest']}\n")
    lines.append(
        f"bytes: PS sent {_bytes(b['ps_egress'])}, received {_bytes(b['ps_ingress'])}"
        + (f"; relays served {_bytes(b['relay_out'])}" if b.get("relay_out") else "")
        + "; per device "
        f"{_bytes(b['device_down_mean'])} down (at most {_bytes(b['device_down_max'])}), "
        f"{_bytes(b['device_up_mean'])} up\n"
    )
    parts = ", ".join(f"{k} {v}" for k, v in c["partitions"].items())
    lines.append(
        f"GEMMs: {c['remote_gemms']} sent out, {c['local_gemms']} kept on the PS ({parts}); "
        f"per step {c['units']:,.0f} leases, {c['copies']:,.0f} copies, {c['lost']:,.0f} lost to leaves; "
        f"{c['leaves']:.0f} leaves, {c['joins']:.0f} joins; {c['devices_used']:,} devices computed\n"
    )
    if "fleet_utilisation" in c:
        q = c["utilisation_quantiles"]
        lines.append(
            f"fleet: devices computed {_share(c['fleet_utilisation'])} of the step on average "
            f"(p10 {_share(q.get('p10'))}, median {_share(q.get('p50'))}, p90 {_share(q.get('p90'))}; "
            f"their links allow at most {_share(c.get('utilisation_ceiling'))}, this step's work "
            f"{_share(c.get('utilisation_bound'))}, the part that can wait "
            f"{_share(c.get('utilisation_wait_bound'))}); "
            f"GEMMs in flight {c['gemms_in_flight']['mean']:.1f} on average, at most {c['gemms_in_flight']['max']}\n"
        )
    forecasts = c.get("micro_batch_forecasts_s")
    if forecasts:
        weighed = ", ".join(f"{m}: {_seconds(s)}" for m, s in forecasts.items())
        chosen = c["micro_batches"]
        lines.append(f"micro-batches: {chosen}, the cost model's choice (forecast step by parts: {weighed})\n")
    lines.append(
        f"the planner predicted {_seconds(c['predicted_s'])} for the last step"
        f"{' (kept every GEMM home)' if c.get('kept_home') else ''}, the coordinator alone "
        f"{_seconds(c['home_s']) if c.get('home_s') is not None else '-'}; "
        f"speedup vs DTFM {_times(speed['vs_dtfm'])}, vs cloud {_times(speed['vs_cloud'])}; "
        f"simulated in {c['wall_s']:.1f} s ({c['events']:,} events)"
    )
    return Group(head, busy, lines)


def simulate_report(report: dict[str, Any]) -> Group:
    """``cleave simulate``: the ``--json`` object (coordinator/whatif/report.py) as tables."""
    title = Text()
    title.append(f"{report['model']['name']} ", style="bold")
    title.append(
        f"({report['model']['params'] / 1e9:.3g} B parameters) on '{report['fleet_spec']}', batch "
        f"{report['batch_size']} x {report['seq_len']} {report['dtype']}"
        f"{' (bf16 on the wire)' if report['wire_dtype'] != report['dtype'] else ''}, PS "
        f"{report['ps'].get('preset', 'server')} on {report['ps']['link_gbps']:g} Gbit/s, "
        f"{report['ps']['gflops']:,.0f} GFLOP/s, "
        f"planner {report['planner']}, churn {'on' if report['churn'] else 'off'}, seed {report['seed']}"
    )
    runs = report.get("sweep") or [report]
    parts: list[Any] = [title]
    if len(runs) > 1:
        table = Table(title="sweep: seconds per batch", title_justify="left")
        for name in ("devices", "Cleave", "binds", "DTFM-style", "cloud", "vs DTFM", "vs cloud"):
            table.add_column(name, justify="right")
        for run in runs:
            table.add_row(
                f"{run['devices']:,}",
                _seconds(run["cleave"]["step_s"]),
                run["cleave"]["bound"],
                _seconds(run["dtfm"]["step_s"]),
                _seconds(run["cloud"]["step_s"]),
                _times(run["speedup"]["vs_dtfm"]),
                _times(run["speedup"]["vs_cloud"]),
            )
        parts.append(table)
    parts += [_sim_run(report, run) for run in runs]
    return Group(*parts)
