"""How many verified tiles per second the coordinator sustains, and its CPU per tile.

Run from the repository root::

    .venv/bin/python bench/bench_throughput.py                      # a table on stdout
    .venv/bin/python bench/bench_throughput.py --devices 200 --seconds 20 --json

The coordinator runs in this process as in a job: the websocket ``Server`` around a ``Core`` on a
real SQLite file, its results verified on the verifier thread. Instead of a trainer, a pump keeps
``--gemms`` GEMMs of ``--size`` x ``--k`` @ ``--k`` x ``--size`` (float32) in flight, cut by the
round-robin planner into output tiles of ``--tile`` on a side, and submits a new one as each
completes. The devices are ``cleave emulate --devices N --fleet F`` in a second process: real
clients on their own websockets, each computing its tiles for real, paced to its class's profile.

Figures, over ``--seconds`` after ``--warmup`` seconds (devices enrol and leave probation then):

* verified tiles per second (goal: 5,000);
* the coordinator's CPU per verified tile (every thread of this process) and the rate that CPU
  would allow on one core of its own (1 / CPU per tile): on this machine the emulator shares the
  cores, so the measured rate is bounded by both processes;
* the share of that CPU on the verifier thread.
"""

from __future__ import annotations

# isort: off
import cleave.cli  # noqa: F401  -- sets OMP_WAIT_POLICY=PASSIVE before torch is imported (2 cores!)
# isort: on

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import wire_floor
from rich.console import Console
from rich.table import Table

from cleave.coordinator.engine.core import Core
from cleave.coordinator.engine.limits import Limits
from cleave.coordinator.net.server import Server, listen
from cleave.coordinator.planning.tiles import GemmKind, TilingPolicy
from cleave.db.sqlite import GROUP_SECONDS, SQLiteStore
from cleave.db.store import DeviceInfo, NewTile, Outcome

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-throughput-token"
GOAL_TILES_PER_S = 5000.0


def _thread_cpu(name_prefix: str) -> float:
    """CPU seconds of this process's Python threads whose name starts with ``name_prefix``
    (Linux: /proc/self/task/<native id>/stat, utime + stime)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for thread in threading.enumerate():
        if not thread.name.startswith(name_prefix) or thread.native_id is None:
            continue
        try:
            fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


async def measure(args: argparse.Namespace, db: Path) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    store = SQLiteStore(str(db), group_seconds=GROUP_SECONDS, defer=loop.call_soon)  # as a job opens it
    job = store.create_job("throughput", {}, 1, time.time())
    policy = TilingPolicy(max_edge=args.tile, min_edge=min(8, args.tile), min_k=args.k, min_tile_flops=1)
    core = Core(
        store,
        job,
        join_token=TOKEN,
        operator_token=TOKEN + "-op",
        rng=np.random.default_rng(),
        policy=policy,
        limits=Limits(),
        epoch=time.time() - time.monotonic(),
    )
    server = Server(core, time.monotonic)
    rng = torch.Generator().manual_seed(0)
    operands = [
        (torch.randn(args.size, args.k, generator=rng), torch.randn(args.k, args.size, generator=rng))
        for _ in range(args.gemms)
    ]
    loop = asyncio.get_running_loop()
    stop = False

    sizes: list[int] = []  # tiles of each GEMM, as the planner cut it

    def pump(i: int) -> None:
        a, b = operands[i]

        def done(_: object) -> None:
            if not stop:
                loop.call_soon(pump, i)

        gemm_id, out = core.submit(a, b, GemmKind.FORWARD, server.clock(), done)
        sizes.append(len(core.gemms[gemm_id].tiles))
        server.deliver(out)

    async with listen(server, "127.0.0.1", 0) as ws_server:
        ticker = asyncio.create_task(server.tick_forever())
        url = f"ws://127.0.0.1:{ws_server.sockets[0].getsockname()[1]}"
        log = open(db.with_suffix(".emulator.log"), "w")  # noqa: SIM115 -- closed below
        emulator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cleave_cli",
                "emulate",
                url,
                "--token",
                TOKEN,
                "--devices",
                str(args.devices),
                "--fleet",
                args.fleet,
                "--slots",
                str(args.slots),
                "--threads",
                "1",
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            await asyncio.wait_for(server.wait_for_devices(args.devices), args.join_timeout)
            for i in range(args.gemms):
                pump(i)
            await asyncio.sleep(args.warmup)
            # Tiles verified as the store counts them: whole GEMMs would blur the window's edges.
            t0, cpu0, ver0 = time.perf_counter(), time.process_time(), _thread_cpu("cleave-verify")
            v0 = core.store.tile_counts(core.job_id)["verified"]
            t = server.traffic

            def counts() -> tuple[int, ...]:
                return (t.frames_up, t.work_frames, t.work_tiles, server.checked, server.check_batches, t.bytes_down)

            counts0 = counts()
            await asyncio.sleep(args.seconds)
            t1, cpu1, ver1 = time.perf_counter(), time.process_time(), _thread_cpu("cleave-verify")
            v1 = core.store.tile_counts(core.job_id)["verified"]
            deltas = [b - a for a, b in zip(counts0, counts(), strict=True)]
            frames_up, work_frames, work_tiles, checked, batches, bytes_down = deltas
        except BaseException:
            log.flush()
            print(db.with_suffix(".emulator.log").read_text()[-2000:], file=sys.stderr)
            raise
        finally:
            stop = True
            server.deliver(core.finish(server.clock()))
            await server.close_all("benchmark over", timeout=5.0)
            ticker.cancel()
            server.stop_verifying()
            try:
                emulator.wait(timeout=30)
            except subprocess.TimeoutExpired:
                emulator.kill()
            log.close()
    store.close()  # after the server: its handlers record each device leaving
    tiles = v1 - v0
    wall, cpu = t1 - t0, cpu1 - cpu0
    per_tile = cpu / tiles if tiles else float("inf")
    return {
        "devices": args.devices,
        "fleet": args.fleet,
        "tile": args.tile,
        "k": args.k,
        "size": args.size,
        "tiles_per_gemm": max(sizes, default=0),
        "seconds": wall,
        "tiles": tiles,
        "tiles_per_s": tiles / wall if wall else 0.0,
        "cpu_s": cpu,
        "cpu_ms_per_tile": 1e3 * per_tile,
        "tiles_per_cpu_s": 1.0 / per_tile if tiles else 0.0,
        "verifier_cpu_share": (ver1 - ver0) / cpu if cpu else 0.0,
        # How much each frame and each verifier batch carried (batching amortises per-frame costs).
        "tiles_per_work_frame": work_tiles / work_frames if work_frames else 0.0,
        "mb_down_per_tile": (bytes_down / tiles / 1e6) if tiles else 0.0,
        "results_per_frame_up": checked / frames_up if frames_up else 0.0,
        "results_per_check_batch": checked / batches if batches else 0.0,
        "goal_tiles_per_s": GOAL_TILES_PER_S,
    }


def store_floor(tiles: int = 4096, batch: int = 64) -> float:
    """Seconds of the store's own per-tile rows (a GEMM's tile rows, a lease, its verified end,
    a credit per device a batch), written as the coordinator writes them: group commit, and one
    ``store.batch`` per verifier batch holding its results' ends and the leases its dispatch
    grants; on a fresh SQLite file. What any design that keeps a row per tile pays."""
    pending: list = []
    with tempfile.TemporaryDirectory(prefix="cleave-bench-store-") as tmp:
        store = SQLiteStore(str(Path(tmp) / "floor.db"), group_seconds=GROUP_SECONDS, defer=pending.append)
        job = store.create_job("floor", {}, 1, 0.0)
        devices = [store.add_device(job, DeviceInfo(f"d{i}"), 0.0) for i in range(batch)]
        started = time.process_time()
        done = 0
        for g in range(1, tiles // 256 + 1):
            ids = store.add_gemm(
                g, job, 1, "fwd", (512, 512, 64), [NewTile(i, f"a{g}.{i}", f"b{g}.{i}", 1) for i in range(256)], 1.0
            )
            leased: list[int] = []
            for first in range(0, len(ids) + batch, batch):
                with store.batch():  # a verifier batch: its results' ends, credits, then the dispatch's leases
                    for device, tile in zip(devices, leased, strict=False):
                        store.end_lease(tile, device, Outcome.VERIFIED, 2.0)
                        store.credit_device(device, verified=1, gflop=1e-4, now=2.0)
                    done += len(leased)
                    leased = ids[first : first + batch]
                    for device, tile in zip(devices, leased, strict=False):
                        store.lease_tile(tile, device, 1.0)
                for flush in pending:
                    flush()
                pending.clear()
        seconds = time.process_time() - started
        store.close()
    return seconds / done


def floors(r: dict[str, Any]) -> dict[str, Any]:
    """The per-tile floor of this design on this machine, measured now: plain websockets'
    CPU for one work frame down and one result frame up (wire_floor.py, frames of this run's
    mean size), the store's rows, and the verifier's CPU per tile in the run. Anything the
    coordinator does besides (scheduling, the Core's books, asyncio) comes on top."""
    frame = max(1024, int(r["mb_down_per_tile"] * 1e6 * r["tiles_per_work_frame"]))
    count = 20_000
    wire = wire_floor.measure(mb=max(1, (count * frame) >> 20), message=frame)
    messages = wire["bytes"] / 2 / frame
    per_frame = max(1.0, min(r["tiles_per_work_frame"], r["results_per_frame_up"]))  # tiles a frame carried
    wire_ms = 1e3 * wire["server_cpu_s"] / messages / per_frame
    store_ms = 1e3 * store_floor()
    verify_ms = r["cpu_ms_per_tile"] * r["verifier_cpu_share"]
    return {
        "wire_ms_per_tile": wire_ms,
        "store_ms_per_tile": store_ms,
        "verify_ms_per_tile": verify_ms,
        "floor_ms_per_tile": wire_ms + store_ms + verify_ms,
        "floor_frame_bytes": frame,
    }


def render(r: dict[str, Any], console: Console) -> None:
    table = Table(
        title=f"Coordinator throughput: {r['devices']} emulated devices ({r['fleet']}), "
        f"{r['tile']}x{r['tile']} tiles (k = {r['k']}), {r['seconds']:.1f} s measured",
        title_justify="left",
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("verified tiles per second (goal 5,000)", f"{r['tiles_per_s']:,.0f}")
    table.add_row("coordinator CPU per verified tile (all threads)", f"{r['cpu_ms_per_tile']:.3f} ms")
    table.add_row("tiles per second that CPU allows on one core", f"{r['tiles_per_cpu_s']:,.0f}")
    table.add_row("share of that CPU on the verifier thread", f"{r['verifier_cpu_share']:.1%}")
    table.add_row("tiles per work frame (down)", f"{r['tiles_per_work_frame']:.2f}")
    table.add_row("results per frame (up)", f"{r['results_per_frame_up']:.2f}")
    table.add_row("results per verifier batch", f"{r['results_per_check_batch']:.1f}")
    if "floor_ms_per_tile" in r:
        table.add_row("floor: plain websockets, a frame each way per tile", f"{r['wire_ms_per_tile']:.3f} ms")
        table.add_row("floor: the store's rows per tile", f"{r['store_ms_per_tile']:.3f} ms")
        table.add_row("floor: verification per tile (in the run)", f"{r['verify_ms_per_tile']:.3f} ms")
        table.add_row("floor of this design (their sum; goal 0.2 ms)", f"{r['floor_ms_per_tile']:.3f} ms")
    console.print(table)
    console.print(
        f"{r['tiles']:,} tiles verified; {r['tiles_per_gemm']} tiles per GEMM of {r['size']}x{r['k']} @ "
        f"{r['k']}x{r['size']}. The emulator shares this machine's cores.",
        style="dim",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--devices", type=int, default=200)
    p.add_argument("--fleet", default="desktop-gpus", help="the emulated fleet (default: desktop-gpus: fast links)")
    p.add_argument("--slots", type=int, default=4, help="tiles each device asks to hold (default: 4)")
    p.add_argument("--tile", type=int, default=32, help="output tile edge (default: 32)")
    p.add_argument("--k", type=int, default=64, help="reduction length of every GEMM (default: 64)")
    p.add_argument("--size", type=int, default=512, help="GEMM rows and columns (default: 512)")
    p.add_argument("--gemms", type=int, default=8, help="GEMMs kept in flight (default: 8)")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring (default: 10)")
    p.add_argument("--seconds", type=float, default=20.0, help="seconds measured (default: 20)")
    p.add_argument("--join-timeout", type=float, default=120.0, help="seconds to wait for every device to join")
    p.add_argument("--no-floor", action="store_true", help="skip the per-tile floor (websockets, store) after the run")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    if args.devices < 1 or args.tile < 1 or args.k < 1 or args.size < args.tile or args.gemms < 1:
        p.error("need --devices, --tile, --k, --gemms >= 1 and --size >= --tile")
    logging.getLogger("cleave").setLevel(logging.ERROR)  # enrolment refusals while 200 join: expected
    with tempfile.TemporaryDirectory(prefix="cleave-bench-throughput-") as tmp:
        result = asyncio.run(measure(args, Path(tmp) / "throughput.db"))
    if not args.no_floor:
        result.update(floors(result))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render(result, Console(highlight=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
