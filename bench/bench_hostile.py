"""The hostile-crowd drill: a job trains while 1,000 enrolled devices sit connected and idle and
200 unauthenticated peers pester the coordinator. Measured in one run:

* memory per enrolled idle connection, and the coordinator's peak resident memory against the
  bound docs/security.md states for its limits;
* step time with the crowd against the same job's quiet steps (ratios side by side);
* verification: the coordinator's seconds in Freivalds' check per verified tile, and against
  the clients' matmul seconds.

    .venv/bin/python bench/bench_hostile.py [--enrolled 1000] [--junk 200] [--model small] [--json]

The coordinator and two `cleave join` clients (1 thread each) are separate processes; the crowd
runs in this process. Enrolled devices are created in the database beforehand (the coordinator
rate-limits enrolments to 5 a second) and connect with their credentials, paused (an owner at
the keyboard), so they hold no work, and heartbeat every 2 s. Half the junk peers open a
websocket and never say hello (reconnecting when the hello timeout closes them); the other
half declare a 96 MiB frame, send its first MiB and wait to be thrown out, once a second.
Everything shares this machine's cores, so the step-time ratio includes the crowd's own CPU
(shown per phase). tests/drills/test_hostile.py streams whole 96 MiB frames against the memory bound.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import secrets
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from websockets.asyncio.client import ClientConnection, connect  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402

import cleave.cli  # noqa: E402,F401 - OMP_WAIT_POLICY (the upgrade limits are set where servers are built)
from cleave.cli.status import fetch_status  # noqa: E402
from cleave.coordinator.engine.limits import HEADROOM, Limits, memory_bound, peer_costs  # noqa: E402
from cleave.db.sqlite import SQLiteStore  # noqa: E402
from cleave.wire import auth  # noqa: E402
from cleave.wire.messages import Challenge, Heartbeat, Hello, Welcome, decode, encode  # noqa: E402

TOKEN, OPERATOR = "bench-join", "bench-operator"
err = Console(stderr=True, highlight=False)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Cpu:
    """CPU seconds per wall second, of the coordinator and of this process (the crowd), per phase."""

    def __init__(self, pid: int) -> None:
        self.procs = {"coordinator": psutil.Process(pid), "crowd": psutil.Process()}
        self.at = time.monotonic()
        self.used = self._used()

    def _used(self) -> dict[str, float]:
        return {k: sum(p.cpu_times()[:2]) for k, p in self.procs.items()}

    def mark(self) -> dict[str, float]:
        now, used = time.monotonic(), self._used()
        wall = max(1e-9, now - self.at)
        share = {k: round((used[k] - self.used[k]) / wall, 3) for k in used}
        self.at, self.used = now, used
        return share


@dataclass
class Sampler:
    """The coordinator's resident memory, ten times a second, in a thread."""

    pid: int
    peak: int = 0
    last: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Sampler:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        proc = psutil.Process(self.pid)
        while not self._stop.is_set():
            try:
                self.last = proc.memory_info().rss
            except psutil.Error:
                return
            self.peak = max(self.peak, self.last)
            time.sleep(0.1)

    def settle(self, seconds: float = 1.5) -> int:
        """The median of the samples over a short while: a steady reading."""
        values = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            values.append(self.last)
            time.sleep(0.1)
        return int(statistics.median(values))

    def stop(self) -> None:
        self._stop.set()


def _metrics(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # being written
    return rows


async def _wait_steps(path: Path, count: int, after: int) -> list[dict]:
    while True:
        rows = [r for r in _metrics(path) if r["step"] > after]
        if len(rows) >= count:
            return rows[:count]
        await asyncio.sleep(0.1)


async def _idle_device(
    url: str, identity: int, secret: bytes, ready: asyncio.Event, stop: asyncio.Event, opened: list[int]
) -> None:
    """An enrolled device whose owner is busy: connects with its credential, pauses, heartbeats."""
    async with connect(url, compression=None, max_size=None, open_timeout=60, ping_interval=None) as ws:
        challenge = decode(await ws.recv())
        assert isinstance(challenge, Challenge)
        proof = auth.proof(secret, identity, bytes.fromhex(challenge.nonce))
        await ws.send(
            encode(
                Hello(
                    name=f"idle-{identity}",
                    identity=identity,
                    proof=proof.hex(),
                    slots=1,
                    paused="the owner is at the keyboard",
                )
            )
        )
        while not isinstance(decode(await ws.recv()), Welcome):
            pass
        opened.append(identity)
        ready.set()
        reader = asyncio.create_task(_drain(ws))
        try:
            while not stop.is_set():
                await ws.send(encode(Heartbeat()))
                try:
                    await asyncio.wait_for(stop.wait(), 2.0)
                except (TimeoutError, asyncio.TimeoutError):
                    pass
        finally:
            reader.cancel()


async def _drain(ws: ClientConnection) -> None:
    try:
        async for _ in ws:
            pass
    except ConnectionClosed:
        pass


async def _crowd(
    url: str, credentials: list[tuple[int, bytes]], stop: asyncio.Event
) -> tuple[list[asyncio.Task], list[int]]:
    opened: list[int] = []
    tasks = []
    for start in range(0, len(credentials), 50):  # in waves: a crowd arrives, not a single burst
        wave = []
        for identity, secret in credentials[start : start + 50]:
            ready = asyncio.Event()
            tasks.append(asyncio.create_task(_idle_device(url, identity, secret, ready, stop, opened)))
            wave.append(ready)
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in wave)), 120)
    return tasks, opened


def _junk(port: int, stop: threading.Event, big: bool, counts: dict[str, int]) -> None:
    """One unauthenticated pest: idles past the hello timeout, or streams a 96 MiB frame."""
    while not stop.is_set():
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
        except OSError:
            counts["refused"] += 1
            time.sleep(0.5)
            continue
        try:
            key = base64.b64encode(os.urandom(16))
            s.sendall(
                b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: " + key + b"\r\nSec-WebSocket-Version: 13\r\n\r\n"
            )
            counts["opened"] += 1
            if big:  # declares a 96 MiB frame, sends its first MiB, and waits to be thrown out
                s.sendall(b"\x82\xff" + struct.pack(">Q", 96 << 20) + os.urandom(4) + bytes(1 << 20))
            while not stop.is_set() and s.recv(65536):
                pass
            if big:
                stop.wait(1.0)  # then again, once a second
        except OSError:
            counts["cut"] += 1
        finally:
            s.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--enrolled", type=int, default=1000, help="idle enrolled connections")
    parser.add_argument("--junk", type=int, default=200, help="unauthenticated junk connections")
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--phase-steps", type=int, default=8, help="steps measured in each phase")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    result = asyncio.run(drill(args))
    if args.json:
        Console().out(json.dumps(result, sort_keys=True))
    else:
        Console().print(_table(result))
    return 0


async def drill(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="cleave-hostile-") as tmp_name:
        tmp = Path(tmp_name)
        db, metrics = tmp / "crowd.db", tmp / "crowd.jsonl"
        store = SQLiteStore(db)  # the crowd enrolled earlier (the coordinator limits enrolments to 5 a second)
        credentials = []
        for i in range(args.enrolled):
            secret = secrets.token_bytes(auth.SECRET_BYTES)
            credentials.append((store.enrol(f"idle-{i}", auth.stored_key(secret), time.time()), secret))
        store.close()
        port = _free_port()
        url = f"ws://127.0.0.1:{port}"
        coordinator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cleave",
                "coordinator",
                "start",
                "--linger",
                "0",
                "--port",
                str(port),
                "--db",
                str(db),
                "--token",
                TOKEN,
                "--operator-token",
                OPERATOR,
                "--model",
                args.model,
                "--steps",
                "1000000",
                "--batch-size",
                str(args.batch_size),
                "--seq-len",
                str(args.seq_len),
                "--min-devices",
                "2",
                "--checkpoint-every",
                "0",
                "--metrics",
                str(metrics),
                "--quiet",
            ],
            env=_env(),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        clients = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "cleave",
                    "join",
                    url,
                    "--token",
                    TOKEN,
                    "--quiet",
                    "--threads",
                    "1",
                    "--device",
                    "cpu",
                    "--always",
                    "--name",
                    f"worker-{i}",
                ],
                env=_env(),
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for i in range(2)
        ]
        sampler = Sampler(coordinator.pid).start()
        cpu = _Cpu(coordinator.pid)
        stop_crowd, stop_junk = asyncio.Event(), threading.Event()
        junk_counts = {"opened": 0, "cut": 0, "refused": 0}
        junk_threads: list[threading.Thread] = []
        tasks: list[asyncio.Task] = []
        try:
            err.print(f"coordinator on {url}; warming up ...")
            warm = await _wait_steps(metrics, 3, 0)
            last = warm[-1]["step"]
            cpu.mark()
            quiet = await _wait_steps(metrics, args.phase_steps, last)
            cpu_quiet = cpu.mark()
            last = quiet[-1]["step"]
            before_crowd = sampler.settle()
            err.print(
                f"quiet: {statistics.mean(r['seconds'] for r in quiet) * 1e3:.1f} ms/step; "
                f"connecting {args.enrolled} enrolled idle devices ..."
            )
            t0 = time.monotonic()
            tasks, opened = await _crowd(url, credentials, stop_crowd)
            connect_s = time.monotonic() - t0
            await asyncio.sleep(3.0)  # heartbeats flowing
            with_crowd = sampler.settle()
            last = _metrics(metrics)[-1]["step"]
            cpu.mark()
            crowd = await _wait_steps(metrics, args.phase_steps, last)
            cpu_crowd = cpu.mark()
            last = crowd[-1]["step"]
            err.print(
                f"with the crowd: {statistics.mean(r['seconds'] for r in crowd) * 1e3:.1f} ms/step; "
                f"adding {args.junk} unauthenticated pests ..."
            )
            for i in range(args.junk):
                t = threading.Thread(target=_junk, args=(port, stop_junk, i % 2 == 1, junk_counts), daemon=True)
                t.start()
                junk_threads.append(t)
            await asyncio.sleep(2.0)
            last = _metrics(metrics)[-1]["step"]
            cpu.mark()
            pests = await _wait_steps(metrics, args.phase_steps, last)
            cpu_pests = cpu.mark()
            status = await asyncio.to_thread(fetch_status, url, OPERATOR)
        finally:
            stop_junk.set()
            stop_crowd.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            coordinator.send_signal(signal.SIGINT)
            try:
                coordinator.wait(30)
            except subprocess.TimeoutExpired:
                coordinator.kill()
            for c in clients:
                c.kill()
                c.wait()
            sampler.stop()
    lim = Limits()
    bound = memory_bound(lim, devices_holding=2, largest_result=16 << 20, largest_frame=16 << 20)
    cost = peer_costs(lim, largest_result=16 << 20)
    present = (
        args.enrolled * cost["idle_device"]
        + min(args.junk, lim.unauthenticated + HEADROOM) * cost["unauthenticated"]
        + 2 * cost["working_device"]
        + lim.outbound_total
        + (16 << 20)
    )
    mean = lambda rows: statistics.mean(r["seconds"] for r in rows)  # noqa: E731
    tiles = status["tiles"]["verified"]
    compute = sum(d.get("compute_s") or 0.0 for d in status["devices"])
    return {
        "config": {
            "model": args.model,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "enrolled": args.enrolled,
            "junk": args.junk,
            "phase_steps": args.phase_steps,
        },
        "memory": {
            "before_crowd_mb": round(before_crowd / 1e6, 1),
            "with_crowd_mb": round(with_crowd / 1e6, 1),
            "per_enrolled_connection_kib": round((with_crowd - before_crowd) / max(1, len(opened)) / 1024, 1),
            "peak_mb": round(sampler.peak / 1e6, 1),
            "bound_total_mb": round(bound["total"] / 1e6, 1),
            "bound_for_this_crowd_mb": round(present / 1e6, 1),
            "growth_mb": round((sampler.peak - before_crowd) / 1e6, 1),
            "bound_terms_mb": {k: round(v / 1e6, 1) for k, v in bound.items()},
        },
        "step_s": {
            "quiet": mean(quiet),
            "enrolled_crowd": mean(crowd),
            "crowd_and_pests": mean(pests),
            "ratio_crowd": mean(crowd) / mean(quiet),
            "ratio_crowd_and_pests": mean(pests) / mean(quiet),
        },
        "crowd": {
            "connected": len(opened),
            "connect_s": round(connect_s, 2),
            "coordinator_connections": status.get("connections", {}),
        },
        "pests": junk_counts,
        "cpu": {"quiet": cpu_quiet, "enrolled_crowd": cpu_crowd, "crowd_and_pests": cpu_pests},
        "verify": {
            "seconds": status["verify"]["seconds"],
            "tiles": tiles,
            "ms_per_tile": 1e3 * status["verify"]["seconds"] / tiles if tiles else 0.0,
            "over_client_matmul": status["verify"]["seconds"] / compute if compute else 0.0,
            "worst_honest_ratio": status["verify"]["worst_honest_ratio"],
        },
    }


def _table(r: dict) -> Table:
    m, s, v = r["memory"], r["step_s"], r["verify"]
    c = r["config"]
    table = Table(
        title=f"hostile crowd: {c['model']} (batch {c['batch_size']} x seq {c['seq_len']}), "
        f"{c['enrolled']} enrolled idle devices, {c['junk']} unauthenticated pests"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("", justify="right")
    table.add_row(
        "memory per enrolled idle connection",
        f"{m['per_enrolled_connection_kib']:,.1f} KiB",
        f"{r['crowd']['connected']:,} connected in {r['crowd']['connect_s']:.1f} s",
    )
    table.add_row(
        "coordinator RSS: before the crowd / with it", f"{m['before_crowd_mb']:,.0f} / {m['with_crowd_mb']:,.0f} MB", ""
    )
    table.add_row("coordinator RSS: peak", f"{m['peak_mb']:,.0f} MB", f"+{m['growth_mb']:,.0f} MB over the quiet job")
    table.add_row(
        "stated bound: for this crowd / at the default caps",
        f"{m['bound_for_this_crowd_mb']:,.0f} MB",
        f"{m['bound_total_mb']:,.0f} MB",
    )
    cpu = r["cpu"]

    def load(phase: str) -> str:
        return f"coordinator {cpu[phase]['coordinator']:.2f}, crowd {cpu[phase]['crowd']:.2f} cores"

    table.add_row("step time: quiet", f"{s['quiet'] * 1e3:,.1f} ms  1.00x", load("quiet"))
    table.add_row(
        "step time: with the idle crowd",
        f"{s['enrolled_crowd'] * 1e3:,.1f} ms  {s['ratio_crowd']:.2f}x",
        load("enrolled_crowd"),
    )
    table.add_row(
        "step time: crowd + pests",
        f"{s['crowd_and_pests'] * 1e3:,.1f} ms  {s['ratio_crowd_and_pests']:.2f}x",
        load("crowd_and_pests"),
    )
    p = r["pests"]
    table.add_row("pests: connections opened / cut / refused", f"{p['opened']:,} / {p['cut']:,} / {p['refused']:,}", "")
    table.add_row(
        "verification per tile (in the run)",
        f"{v['ms_per_tile']:.3f} ms",
        f"{v['over_client_matmul']:.1%} of client matmul",
    )
    table.add_row("worst honest residual / tolerance", f"{v['worst_honest_ratio']:.3f}", "")
    return table


if __name__ == "__main__":
    raise SystemExit(main())
