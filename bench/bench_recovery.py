"""Recovery from faults: a lost device against a checkpoint restart, measured in one run.

Cleave's promise is that a lost device costs only its outstanding tiles. This benchmark kills
client processes (SIGKILL) while they hold tiles and measures, for each kill, the time from
the kill until every tile the device held has been verified from another device. It then
measures the alternative a plain data-parallel job would face: the coordinator itself is
killed halfway between two checkpoints and restarted, and the clock runs from the restart
until training is back at the step where it died (process start, checkpoint load, reconnects,
recomputing the lost steps).

    .venv/bin/python bench/bench_recovery.py [--model small] [--kills 5] [--checkpoint-every 6] [--json]

Both parts run on this machine with the same model and clients (1 torch thread each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import cleave.cli  # noqa: E402,F401 - sets OMP_WAIT_POLICY before torch loads
from cleave.coordinator.config import CoordinatorConfig  # noqa: E402
from cleave.coordinator.engine.live_plan import Planner  # noqa: E402
from cleave.coordinator.job import serve_job  # noqa: E402
from cleave.coordinator.net.server import Server  # noqa: E402
from cleave.coordinator.training.loop import StepResult, TrainConfig  # noqa: E402

TOKEN = "bench"
err = Console(stderr=True, highlight=False)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}


def _join(url: str, name: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "cleave_cli",
        "join",
        url,
        "--token",
        TOKEN,
        "--once",
        "--quiet",
        "--threads",
        "1",
        "--device",
        "cpu",
        "--always",
        "--name",
        name,
    ]
    return subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class _Quiet:
    def __init__(self) -> None:
        self.last = 0  # the last step done

    def listening(self, *args: object) -> None: ...
    def note(self, text: str) -> None: ...
    def waiting(self, have: int, want: int) -> None: ...
    def finished(self, results: list[StepResult], status: dict) -> None: ...

    def step(self, result: StepResult, status: dict) -> None:
        self.last = result.step


async def client_kills(model: str, kills: int, tmp: Path) -> list[dict]:
    """Kill a client holding tiles, time until its tiles are verified elsewhere; repeat."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[str] = loop.create_future()
    box: dict[str, Server] = {}
    reporter = _Quiet()
    cfg = CoordinatorConfig(
        train=TrainConfig(model=model, steps=10_000, seq_len=256 if model != "tiny" else 64),
        port=0,
        db=str(tmp / "kills.db"),
        token=TOKEN,
        min_devices=3,
        checkpoint_every=0,
        planner=Planner.UNIFORM,
    )  # every GEMM as tiles: recovery is what is measured
    job = asyncio.create_task(
        serve_job(cfg, reporter, ready=ready.set_result, on_start=lambda s: box.setdefault("s", s))
    )
    url = await ready
    procs = {f"c{i}": _join(url, f"c{i}") for i in range(3)}
    samples: list[dict] = []
    try:
        while reporter.last < 2:
            await asyncio.sleep(0.05)
        core = box["s"].core
        for n in range(kills):
            err.print(f"client kill {n + 1}/{kills} ...")
            while True:  # a device that holds tiles right now
                holders = [d for d in core.devices.values() if d.inflight and d.name in procs]
                if holders:
                    break
                await asyncio.sleep(0.0005)
            victim = holders[0]
            held = list(victim.inflight)
            killed_at = time.perf_counter()
            procs[victim.name].send_signal(signal.SIGKILL)
            while any(core.store.tile_state(t) != "verified" for t in held):
                await asyncio.sleep(0.0002)
            samples.append({"tiles": len(held), "seconds": time.perf_counter() - killed_at})
            procs[victim.name].wait()
            del procs[victim.name]
            fresh = f"c{len(samples) + 2}"
            procs[fresh] = _join(url, fresh)
            while len(core.devices) < 3:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
    finally:
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        for p in procs.values():
            p.kill()
            p.wait()
    return samples


def _steps(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    steps = 0
    for line in metrics.read_text().splitlines():
        try:
            steps = max(steps, json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):
            continue  # a line being written right now
    return steps


def _coordinator(tmp: Path, model: str, every: int, port: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "cleave_cli",
        "coordinator",
        "start",
        "--linger",
        "0",
        "--port",
        str(port),
        "--db",
        str(tmp / "ck.db"),
        "--token",
        TOKEN,
        "--model",
        model,
        "--steps",
        "10000",
        "--checkpoint-every",
        str(every),
        "--min-devices",
        "2",
        "--metrics",
        str(tmp / "ck.jsonl"),
        "--quiet",
    ]
    if model != "tiny":
        cmd += ["--seq-len", "256"]
    return subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def checkpoint_restart(model: str, every: int, tmp: Path) -> dict:
    """Kill the coordinator mid-way between checkpoints; time the restart back to that step."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"ws://127.0.0.1:{port}"
    metrics = tmp / "ck.jsonl"
    coord = _coordinator(tmp, model, every, port)
    time.sleep(2.0)
    clients = [_join(url, f"r{i}") for i in range(2)]
    try:
        died_at_step = every + every // 2  # half an interval of work is lost, on average
        err.print(f"checkpoint restart: training to step {died_at_step}, then SIGKILL ...")
        while _steps(metrics) < died_at_step:
            time.sleep(0.02)
        coord.send_signal(signal.SIGKILL)
        coord.wait()
        restarted = time.perf_counter()
        coord = _coordinator(tmp, model, every, port)
        # The restarted coordinator first cuts the metrics file back to its checkpoint ...
        while _steps(metrics) >= died_at_step:
            time.sleep(0.005)
        # ... then recomputes the lost steps; the clock stops when it is back where it died.
        while _steps(metrics) < died_at_step:
            if coord.poll() is not None:
                raise RuntimeError("restarted coordinator exited")
            time.sleep(0.005)
        return {"seconds": time.perf_counter() - restarted, "lost_steps": died_at_step - every}
    finally:
        coord.kill()
        for c in clients:
            c.kill()
            c.wait()
        coord.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=["tiny", "small", "base"])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--checkpoint-every", type=int, default=6)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cleave-recovery-") as tmp:
        kills = asyncio.run(client_kills(args.model, args.kills, Path(tmp)))
        restart = checkpoint_restart(args.model, args.checkpoint_every, Path(tmp))
    seconds = [k["seconds"] for k in kills]
    median = statistics.median(seconds)
    result = {
        "model": args.model,
        "client_kill": {"median_s": median, "max_s": max(seconds), "samples": kills},
        "checkpoint_restart": restart,
        "ratio_restart_over_kill": restart["seconds"] / median,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    table = Table(title=f"recovery, {args.model} model, clients with 1 thread each (2 cores)")
    table.add_column("what")
    table.add_column("time", justify="right")
    table.add_column("detail")
    table.add_row(
        "client SIGKILL -> its tiles verified elsewhere (median)",
        f"{median * 1000:.1f} ms",
        f"{len(kills)} kills; max {max(seconds) * 1000:.1f} ms; "
        f"{statistics.mean(k['tiles'] for k in kills):.1f} tiles held on average",
    )
    table.add_row(
        "coordinator SIGKILL -> back at the same step (restart)",
        f"{restart['seconds']:.2f} s",
        f"process start, checkpoint load, reconnects, {restart['lost_steps']} steps recomputed "
        f"(checkpoint every {args.checkpoint_every})",
    )
    table.add_row("ratio", f"{result['ratio_restart_over_kill']:,.0f}x", "checkpoint restart / device loss")
    Console().print(table)


if __name__ == "__main__":
    main()
