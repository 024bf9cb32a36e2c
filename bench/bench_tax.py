"""The coordinator's tax on realistic tiles: its CPU per verified tile over that tile's GEMM.

Run from the repository root::

    .venv/bin/python bench/bench_tax.py                          # 3 shapes, tile and band checks
    .venv/bin/python bench/bench_tax.py --shapes qkv-fwd --check band --seconds 20 --json
    .venv/bin/python bench/bench_tax.py --repeat 3 --grid q-dw=2x4x2

However large and fast the fleet, a step whose GEMMs all go out costs the coordinator at least
``tax`` of what computing them itself would (its checks, framing, books, assembly), so the fleet
can make the GEMMs at most ``1 / tax`` faster (../shared/design/scale-notes.md, "The
coordinator's tax"). The goal is a tax of at most 3%.

Tile shapes are those the cost model ships for Llama-2-7B (``cleave plan --model llama2-7b
--fleet mixed --devices 1024 --batch-size 64 --seq-len 1024 --dtype bf16 --ps-link-gbps 400``),
each GEMM scaled down to a few cells of its real grid (``--grid`` picks others; the tiles keep
their shape) so that it fits here, in float32 (bf16 is about 100x slower on this CPU):

* ``qkv-fwd``: q/k/v/o forward (and dX), 65536x4096x4096 cut 128x10x1: output tiles of
  512 x 410 x 4096; here 2048 tokens, 4 x 10 x 1;
* ``q-dw``: their dW, 4096x4096x65536 cut 8x16x8 (3d): split-K tiles of 512 x 256 x 8192;
  here 1024 x 4096 x 16384, 2 x 16 x 2 (every A block shared by 16 tiles, as in the real grid);
* ``gate-dx``: gate/up dX, 65536x4096x11008 cut 128x9x2 (3d): 512 x 455 x 5504, split-K 2;
  here 2048 tokens, 4 x 9 x 2;
* ``gate-fwd`` (not run by default): 65536x11008x4096 cut 128x11x1: 512 x 1001 x 4096.

Operands are laid out as training lays them (``coordinator/training/linear.py``): forward
``X @ W^T``, dX ``dY @ W``, dW ``dY^T @ X``, so blocks travel as they would (``W^T``'s as
transposed views, strided slices copied once). The grid is forced (a ``LivePlanner`` that returns
it), and the tile shapes are printed.

The coordinator runs in this process as in a job, as in bench_throughput.py: the websocket
``Server`` around a ``Core`` (``band_checks`` as ``--check`` says) on a real SQLite file, its
results verified on the verifier thread. A pump keeps ``--gemms`` GEMMs in flight, each on its
own operands, and submits the same operands again as each completes, as new tensors to the
coordinator (its block keys swept, as at a step's start), so every GEMM's blocks go down again
as a step's would. The devices are ``--devices`` real clients (``client.runner.Worker``, the real
protocol and websockets) in one second process whose compute replays: it keys each (A block, B
block) pair by shape, dtype and a dozen values at fixed positions, computes ``A @ B`` the first
time and returns the cached product (with the seconds it took) after that: the clients cost
little but their bytes, and every result is still checked for real. Devices are trusted
(probation shortened to ``--probation`` tiles): the steady state of a known fleet.

After a warm-up (every operand set's GEMM completed once, so every later result is a replay, and
every device off probation) it measures over ``--seconds``:

* verified tiles per second (counted in the store); a run fails, and the exit status says so,
  on any rejected result, any device lost, or no tile verified;
* the coordinator's CPU per verified tile (``time.process_time``: every thread), split into the
  verifier thread (``cleave-verify``), the event loop, and the rest (torch's intra-op pool, which
  a check with more than one torch thread also uses, and other threads);
* the tile's GEMM on one core of this machine (median thread CPU time of ``torch.matmul`` on
  contiguous float32 of the tile's shape, one torch thread, 7 samples in this process before
  each run, the median of all a shape's samples);
* the tax (CPU per tile / GEMM seconds), its ceiling 1 / tax, and the MB down and up per tile;
* the physical floor, measured in the same run (``socket_floor``): what this process's CPU pays to
  move a MB over loopback TCP with nothing but the kernel in the way, and so what the tile's
  bytes alone cost (``tax floor``); the tax over that floor says how much framing, checks and
  books add to the bytes;
* how busy each process was (cores): on two cores the clients' process shares the machine.

``--check both`` (the default) runs tile checks, then band checks, on each shape and prints them
side by side with their ratio; ``--repeat N`` runs each N times, alternating, and shows medians.
"""

from __future__ import annotations

# isort: off
import cleave.cli  # noqa: F401  -- sets OMP_WAIT_POLICY=PASSIVE before torch is imported (2 cores!)
# isort: on

import argparse
import asyncio
import concurrent.futures
import dataclasses
import gc
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_throughput import _thread_cpu
from rich.console import Console
from rich.table import Table

from cleave.client.idle import Reading
from cleave.client.policy import PolicyConfig
from cleave.client.runner import Worker, WorkerConfig
from cleave.coordinator.engine.core import Core
from cleave.coordinator.engine.gemms import check_finite
from cleave.coordinator.engine.limits import Limits, TrustPolicy
from cleave.coordinator.engine.live_plan import LivePlan, LivePlanner, Planner
from cleave.coordinator.net.server import Server, listen
from cleave.coordinator.planning.costmodel import Profile, PSProfile
from cleave.coordinator.planning.tiles import GemmKind, TilePlan, TilingPolicy, even_cuts
from cleave.db.sqlite import GROUP_SECONDS, SQLiteStore

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-tax-token"
GOAL_TAX = 0.03
MODES = ("tile", "band")
LOGGERS = ("cleave", "coordinator")  # the coordinator's loggers (the server's is cleave.server)


# --------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """One GEMM of Llama-2-7B as the cost model cuts it, and the scaled-down GEMM run here:
    ``grid`` cells of the real ``real_grid``, so every tile keeps the real one's shape."""

    name: str
    what: str
    kind: GemmKind
    real: tuple[int, int, int]  # m, n, k of the real GEMM
    real_grid: tuple[int, int, int]  # rows x cols x reduction slabs the cost model cuts it into
    grid: tuple[int, int, int]  # the cells of it run here

    @property
    def gemm(self) -> tuple[int, int, int]:
        """m, n, k of the GEMM run here."""
        m, n, k = (size * part // whole for size, part, whole in zip(self.real, self.grid, self.real_grid, strict=True))
        return m, n, k

    @property
    def tile(self) -> tuple[int, int, int]:
        """The largest tile (rows, cols, k)."""
        m, n, k = (-(-size // parts) for size, parts in zip(self.gemm, self.grid, strict=True))
        return m, n, k

    def operands(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, B)`` laid out as a Linear layer's GEMMs lay them (coordinator/training/linear.py)."""
        m, n, k = self.gemm
        g = torch.Generator().manual_seed(seed)
        if self.kind is GemmKind.FORWARD:  # Y = X W^T: X is tokens x in, W is out x in
            return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).t()
        if self.kind is GemmKind.GRAD_INPUT:  # dX = dY W: dY is tokens x out, W is out x in
            return torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        if self.kind is GemmKind.GRAD_WEIGHT:  # dW = dY^T X: dY is tokens x out, X is tokens x in
            return torch.randn(k, m, generator=g).t(), torch.randn(k, n, generator=g)
        raise ValueError(f"no layout for {self.kind}")


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("qkv-fwd", "q/k/v/o fwd, output", GemmKind.FORWARD, (65536, 4096, 4096), (128, 10, 1), (4, 10, 1)),
        Shape("q-dw", "q/k/v/o dW, 3d", GemmKind.GRAD_WEIGHT, (4096, 4096, 65536), (8, 16, 8), (2, 16, 2)),
        Shape("gate-dx", "gate/up dX, 3d", GemmKind.GRAD_INPUT, (65536, 4096, 11008), (128, 9, 2), (4, 9, 2)),
        Shape("gate-fwd", "gate/up fwd, output", GemmKind.FORWARD, (65536, 11008, 4096), (128, 11, 1), (4, 11, 1)),
    )
}
DEFAULT_SHAPES = ("qkv-fwd", "q-dw", "gate-dx")


class FixedGrid(LivePlanner):
    """Cuts every GEMM into ``grid`` (rows x cols x reduction slabs), whoever is connected: the
    cost model's partition for the real GEMM, forced here; the tiles go to whoever is free."""

    def __init__(self, grid: tuple[int, int, int]) -> None:
        super().__init__(Planner.UNIFORM, PSProfile(), TilingPolicy(max_edge=1 << 20, min_edge=1, min_k=1))
        self.grid = grid

    def plan(
        self,
        m: int,
        n: int,
        k: int,
        kind: GemmKind,
        dtype: str,
        profiles: Mapping[int, Profile] | Any,
        version: int | None = None,
        now: float = 0.0,
    ) -> LivePlan:
        rows, cols, slabs = self.grid
        return LivePlan(TilePlan(m, n, k, even_cuts(m, rows), even_cuts(n, cols), even_cuts(k, slabs)), {}, None)


def gemm_samples(m: int, n: int, k: int, repeats: int = 7) -> list[float]:
    """Seconds of ``(m x k) @ (k x n)`` on one core (contiguous float32, one torch thread), each
    the calling thread's CPU time, which other processes on the machine do not stretch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.matmul(a, b)  # warm
        times = []
        for _ in range(repeats):
            started = time.thread_time()
            torch.matmul(a, b)
            times.append(time.thread_time() - started)
        return times
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- the clients' process


class Replay:
    """A device's compute that computes each distinct product once and replays it after that.
    A block is known by its shape, dtype and ``samples`` values at fixed positions (the operands
    are random, so that is unique in practice); the pair's product is computed the first time."""

    def __init__(self, samples: int = 12) -> None:
        self.samples = samples
        self._at: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._done: dict[tuple, tuple[torch.Tensor, float]] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def _key(self, x: torch.Tensor) -> tuple:
        shape = (int(x.shape[0]), int(x.shape[1]))
        at = self._at.get(shape)
        if at is None:
            rng = np.random.default_rng(list(shape))
            at = (
                torch.from_numpy(rng.integers(0, max(1, shape[0]), self.samples)),
                torch.from_numpy(rng.integers(0, max(1, shape[1]), self.samples)),
            )
            self._at[shape] = at
        return (shape, str(x.dtype), x[at].numpy().tobytes())

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, float]:
        key = (self._key(a), self._key(b))
        done = self._done.get(key)
        if done is not None:
            self.hits += 1
            return done
        started = time.perf_counter()
        c = a @ b
        done = (c, time.perf_counter() - started)
        with self._lock:
            self._done[key] = done
            self.misses += 1
        return done


class _Idle:
    """The devices' machine is always idle and on mains."""

    def read(self) -> Reading:
        return Reading()


async def _serve(args: argparse.Namespace) -> dict[str, Any]:
    replay = Replay()
    workers = []
    for i in range(args.devices):
        cfg = WorkerConfig(
            url=args.client,
            token=args.token,
            name=f"tax-{i}",
            device="cpu",
            threads=1,
            slots=args.slots,
            once=True,
            backoff_max=1.0,
            benchmark_seconds=0.0,
            poll_seconds=60.0,
            policy=dataclasses.replace(PolicyConfig.always(), max_memory_mb=args.memory_mb),
            credentials=Path(args.dir) / f"{i}.json",
        )
        worker = Worker(cfg, compute=replay, probe=_Idle())
        worker.stats.benchmark_gflops = args.gflops  # its hello claims one core's rate on this tile
        workers.append(worker)

    async def orphaned() -> None:  # the bench died without stopping us: so do we
        while not args.parent or os.getppid() == args.parent:
            await asyncio.sleep(1.0)
        os._exit(1)

    watchdog = asyncio.create_task(orphaned())
    codes = await asyncio.gather(*(w.run() for w in workers), return_exceptions=True)
    watchdog.cancel()
    return {
        "exit_codes": [c if isinstance(c, int) else repr(c) for c in codes],
        "replay_hits": replay.hits,
        "replay_misses": replay.misses,
        "tiles": sum(w.stats.tiles for w in workers),
        "rejected": sum(w.stats.rejected for w in workers),
    }


def client_main(args: argparse.Namespace) -> int:
    """``--client URL``: run ``--devices`` Workers with the replaying compute until the job ends."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    summary = asyncio.run(_serve(args))
    Path(args.summary).write_text(json.dumps(summary))
    return 0


async def _reap(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait (without blocking the event loop) for ``proc`` to exit; kill it after ``timeout``."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _process_cpu(pid: int) -> float:
    """CPU seconds of process ``pid`` so far (every thread: utime + stime), 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- the coordinator


class _Warnings(logging.Handler):
    """Counts the coordinator's warnings (a device cut, a frame refused): none are expected."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(f"{record.name}: {record.getMessage()}")

    def why(self, core: Core | None = None) -> str:
        """The distinct warnings so far, and why devices that left did, for an error message."""
        gone = [] if core is None else [d.reason for d in core.store.devices(core.job_id) if d.id not in core.devices]
        return "; ".join(dict.fromkeys([*self.seen, *gone])) or "no coordinator warning"


def _say(args: argparse.Namespace, text: str) -> None:
    if not args.quiet:
        print(text, file=sys.stderr, flush=True)


async def measure(
    args: argparse.Namespace, shape: Shape, mode: str, sets: list[tuple[torch.Tensor, torch.Tensor]], tmp: Path
) -> dict[str, Any]:
    """One coordinator (``band_checks`` per ``mode``) and one clients' process, on ``shape``."""
    loop = asyncio.get_running_loop()
    trainer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cleave-trainer")  # as a job's
    tmp.mkdir()
    db = tmp / "tax.db"
    store = SQLiteStore(str(db), group_seconds=GROUP_SECONDS, defer=loop.call_soon)  # as a job opens it
    job = store.create_job(f"tax {shape.name} {mode}", {}, 1, time.time())
    trust = TrustPolicy(probation_tiles=args.probation)
    core = Core(
        store,
        job,
        join_token=TOKEN,
        operator_token=TOKEN + "-op",
        rng=np.random.default_rng(),
        trust=trust,
        limits=Limits(),
        epoch=time.time() - time.monotonic(),
        planner=FixedGrid(shape.grid),
        band_checks=mode.startswith("band"),
    )
    server = Server(core, time.monotonic, send_threads=send_threads_of(mode))
    warnings = _Warnings()
    for name in LOGGERS:
        logging.getLogger(name).addHandler(warnings)
    stop = False
    rounds = [0] * len(sets)
    tile_shapes: Counter[tuple[int, int, int]] = Counter()

    def pump(i: int) -> None:
        if stop:
            return
        a, b = sets[i]

        def trainer_side(product: Callable[[], torch.Tensor]) -> None:
            # What a job's trainer thread does with a shipped GEMM (RemoteEngine.run): assemble
            # its product, and check the next GEMM's operands for NaN before submitting it.
            product()
            check_finite(a, b, shape.kind)
            if not stop:
                loop.call_soon_threadsafe(pump, i)

        def done(product: Callable[[], torch.Tensor]) -> None:
            rounds[i] += 1
            if not stop:
                trainer.submit(trainer_side, product)

        # Blocks of finished GEMMs go (forward's X is otherwise kept for its dW until a step
        # starts): the same operands come as new sources, and their blocks travel again.
        core.begin_step(core.progress.current)
        # As Server.submit does for a job: assembled and checked for NaN on the trainer's thread.
        gemm_id = server.start(a, b, shape.kind, done, finite_checked=True, lazy=True)
        if not tile_shapes:
            for t in core.gemms[gemm_id].tiles.values():
                tile_shapes[(t.r1 - t.r0, t.c1 - t.c0, t.k1 - t.k0)] += 1

    log_path = tmp / "clients.log"
    summary_path = tmp / "clients.json"
    client: subprocess.Popen[bytes] | None = None
    log = open(log_path, "wb")  # noqa: SIM115 -- closed below
    try:
        async with listen(server, "127.0.0.1", 0) as ws_server:
            ticker = asyncio.create_task(server.tick_forever())
            url = f"ws://127.0.0.1:{ws_server.sockets[0].getsockname()[1]}"
            creds = tmp / "credentials"
            creds.mkdir()
            client = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--client",
                    url,
                    "--token",
                    TOKEN,
                    "--devices",
                    str(args.devices),
                    "--slots",
                    str(args.slots),
                    "--memory-mb",
                    str(args.memory_mb),
                    "--gflops",
                    f"{args.gflops[shape.name]:.3f}",
                    "--dir",
                    str(creds),
                    "--summary",
                    str(summary_path),
                    "--parent",
                    str(os.getpid()),
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            ok = False
            try:
                await asyncio.wait_for(server.wait_for_devices(args.devices), args.join_timeout)
                warnings.seen.clear()  # enrolments refused while many join at once: expected, retried
                started = time.perf_counter()
                for i in range(len(sets)):
                    pump(i)
                # Warm-up: every operand set's GEMM done once (every later product is a replay),
                # every device off probation, and at least --warmup seconds.
                while not (
                    min(rounds) >= 1
                    and time.perf_counter() - started >= args.warmup
                    and len(core.devices) == args.devices
                    and not any(d.standing.on_probation(trust) for d in core.devices.values())
                ):
                    if len(core.devices) < args.devices:
                        raise RuntimeError(
                            f"{args.devices - len(core.devices)} devices lost during the warm-up ({warnings.why(core)})"
                        )
                    if time.perf_counter() - started > args.warmup_timeout:
                        raise RuntimeError(
                            f"warm-up not over after {args.warmup_timeout:.0f} s: GEMMs completed per "
                            f"operand set {rounds}, {core.store.tile_counts(core.job_id)['verified']} tiles "
                            f"verified, {server.checked} results checked ({warnings.why(core)})"
                        )
                    if client.poll() is not None:
                        raise RuntimeError(f"the clients' process exited ({client.returncode}) during warm-up")
                    await asyncio.sleep(0.1)
                warm = time.perf_counter() - started
                _say(args, f"  {shape.name} {mode}: warm after {warm:.1f} s (rounds {rounds}); measuring")
                t = server.traffic
                counts0 = core.store.tile_counts(core.job_id)
                t0, cpu0 = time.perf_counter(), time.process_time()
                ver0, loop0, send0 = _thread_cpu("cleave-verify"), _thread_cpu("MainThread"), _thread_cpu("cleave-send")
                train0 = _thread_cpu("cleave-trainer")
                ccpu0 = _process_cpu(client.pid)
                down0, up0, rounds0, checked0 = t.bytes_down, t.bytes_up, sum(rounds), server.checked
                await asyncio.sleep(args.seconds)
                t1, cpu1 = time.perf_counter(), time.process_time()
                ver1, loop1, send1 = _thread_cpu("cleave-verify"), _thread_cpu("MainThread"), _thread_cpu("cleave-send")
                train1 = _thread_cpu("cleave-trainer")
                ccpu1 = _process_cpu(client.pid)
                counts1 = core.store.tile_counts(core.job_id)
                down1, up1, rounds1 = t.bytes_down, t.bytes_up, sum(rounds)
                checked = server.checked - checked0
                lost = args.devices - len(core.devices)
                lost_why = warnings.why(core) if lost else ""
                band_failures = getattr(core, "band_failures", 0)  # bands whose check failed (band checks)
                ok = True
            except Exception:
                log.flush()
                if tail := log_path.read_text(errors="replace")[-3000:]:
                    print(f"the clients' log ends:\n{tail}", file=sys.stderr)
                raise
            finally:
                stop = True
                if not ok:  # failed or interrupted: no goodbyes to wait for
                    client.kill()
                server.deliver(core.finish(server.clock()))
                await server.close_all("benchmark over", timeout=5.0 if ok else 1.0)
                ticker.cancel()
                server.stop_verifying()
                await _reap(client, 30.0)
    finally:
        if client is not None and client.poll() is None:
            client.kill()
            client.wait()
        log.close()
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(warnings)
        trainer.shutdown(wait=True, cancel_futures=True)
        store.close()  # after the server: its handlers record each device leaving
    clients = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    tiles = counts1["verified"] - counts0["verified"]
    rejected = counts1["rejected"]
    if rejected or clients.get("rejected"):
        raise AssertionError(f"{rejected} results rejected: honest replayed products must all pass")
    if tiles <= 0:
        raise AssertionError(f"no tile verified in the {args.seconds:.0f} s window")
    if lost:
        raise AssertionError(f"{lost} devices lost while measuring ({lost_why})")
    if band_failures:
        raise AssertionError(f"{band_failures} band checks failed on honest replayed products")
    wall, cpu = t1 - t0, cpu1 - cpu0
    verify, loop_cpu, send, train = ver1 - ver0, loop1 - loop0, send1 - send0, train1 - train0
    return {
        "shape": shape.name,
        "check": mode,
        "seconds": wall,
        "tiles": tiles,
        "gemms": rounds1 - rounds0,
        "tiles_per_s": tiles / wall,
        "cpu_ms_per_tile": 1e3 * cpu / tiles,
        "verify_ms_per_tile": 1e3 * verify / tiles,
        "verifier_share": verify / cpu if cpu else 0.0,
        "loop_ms_per_tile": 1e3 * loop_cpu / tiles,
        "send_ms_per_tile": 1e3 * send / tiles,
        "trainer_ms_per_tile": 1e3 * train / tiles,
        "other_ms_per_tile": 1e3 * (cpu - verify - loop_cpu - send - train) / tiles,
        # What the loop alone allows (a core of its own): GEMMs shipped in such tiles, a job's
        # loop doing what this one does (its trainer thread assembles and checks for NaN).
        "loop_ceiling_tiles_per_s": tiles / loop_cpu if loop_cpu else None,
        "mb_down_per_tile": (down1 - down0) / tiles / 1e6,
        "mb_up_per_tile": (up1 - up0) / tiles / 1e6,
        "coordinator_cores": cpu / wall,
        "clients_cores": (ccpu1 - ccpu0) / wall,
        "speculative": counts1["speculative"] - counts0["speculative"],
        "cancelled": counts1["cancelled"] - counts0["cancelled"],
        "rejected": rejected,
        "warmup_s": warm,
        "results_checked": checked,
        "tile_shapes": {f"{a}x{b}x{c}": count for (a, b, c), count in sorted(tile_shapes.items())},
        "replay": {key: clients.get(key) for key in ("replay_hits", "replay_misses")},
        "coordinator_warnings": warnings.seen[:10],
    }


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for several runs of a shape and check: each figure's median (a failed run: its error)."""
    for r in runs:
        if "error" in r:
            return r
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs)
    out["repeats"] = len(runs)
    return out


FLOOR_MB = 256  # bytes each way for the socket floor (about a second of this machine's CPU)

_PEER = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
want, buf, got = int(sys.argv[2]), bytearray(1 << 20), 0
while got < want:
    n = s.recv_into(buf)
    if not n:
        break
    got += n
s.sendall(b"x")
block = memoryview(bytearray(1 << 20))
for _ in range(want >> 20):
    s.sendall(block)
s.recv(1)
"""


def socket_floor(mb: int = FLOOR_MB) -> dict[str, float]:
    """What moving bytes costs this process with nothing but the kernel in the way: its CPU per
    MB (1e6 bytes) to ``sendall`` 10 MiB buffers to, and to ``recv_into`` 1 MiB from, a peer
    process over loopback TCP. The coordinator can pay no less for its frames' bytes here;
    ``tax floor`` is what a tile's bytes alone cost at these rates."""
    nbytes = mb << 20
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    peer = subprocess.Popen([sys.executable, "-c", _PEER, str(srv.getsockname()[1]), str(nbytes)])
    try:
        conn, _ = srv.accept()
        block = memoryview(bytearray(10 << 20))
        c0 = time.process_time()
        for _ in range(nbytes // len(block)):
            conn.sendall(block)
        left = nbytes % len(block)
        if left:
            conn.sendall(block[:left])
        conn.recv(1)
        send = time.process_time() - c0
        buf, got = bytearray(1 << 20), 0
        c0 = time.process_time()
        while got < nbytes:
            n = conn.recv_into(buf)
            if not n:
                raise RuntimeError("the floor's peer closed early")
            got += n
        recv = time.process_time() - c0
        conn.sendall(b"x")
        conn.close()
    finally:
        srv.close()
        peer.wait(timeout=30)
    return {"send_ms_per_mb": 1e3 * send / (nbytes / 1e6), "recv_ms_per_mb": 1e3 * recv / (nbytes / 1e6)}


def run_shape(args: argparse.Namespace, shape: Shape, tmp: Path) -> dict[str, Any]:
    """Every check mode on ``shape``, ``--repeat`` times, alternating; one row per mode (medians).
    The tile's GEMM is timed before every run (this machine's speed drifts with its load) and
    the median of all those samples is the shape's, so both modes' taxes share one denominator."""
    m, n, k = shape.tile
    samples = gemm_samples(m, n, k)
    args.gflops[shape.name] = 2.0 * m * n * k / statistics.median(samples) / 1e9
    sm, sn, sk = shape.gemm
    _say(
        args,
        f"{shape.name} ({shape.what}): real {'x'.join(map(str, shape.real))} cut "
        f"{'x'.join(map(str, shape.real_grid))}; here {sm}x{sn}x{sk} cut {'x'.join(map(str, shape.grid))}; "
        f"tile {m}x{n}x{k}: {1e3 * statistics.median(samples):.1f} ms on one core "
        f"({args.gflops[shape.name]:.0f} GFLOP/s)",
    )
    sets = [shape.operands(seed) for seed in range(args.gemms)]
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
    for repeat in range(args.repeat):
        for mode in args.modes:
            if repeat or mode != args.modes[0]:
                samples += gemm_samples(m, n, k)
            try:
                r = asyncio.run(measure(args, shape, mode, sets, tmp / f"{shape.name}-{mode}-{repeat}"))
            except Exception as exc:  # noqa: BLE001 -- reported, the other runs go on, and the exit status says so
                print(f"  {shape.name} {mode} FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                runs[mode].append({"shape": shape.name, "check": mode, "error": f"{type(exc).__name__}: {exc}"})
                continue
            finally:
                gc.collect()  # the run's Core and its blocks' copies sit in reference cycles: free them now
            _say(args, f"  tile shapes {r['tile_shapes']}; replay {r['replay']}")
            _say(
                args,
                f"  {mode}: {r['tiles']} tiles in {r['seconds']:.1f} s, {r['tiles_per_s']:.1f}/s, "
                f"{r['cpu_ms_per_tile']:.2f} ms CPU a tile",
            )
            for line in r["coordinator_warnings"]:
                _say(args, f"  coordinator warning: {line}")
            runs[mode].append(r)
    gemm_ms = 1e3 * statistics.median(samples)
    floor = args.floor
    for r in (r for rs in runs.values() for r in rs if "error" not in r):
        r["gemm_ms"] = gemm_ms
        r["tax"] = r["cpu_ms_per_tile"] / gemm_ms
        r["ceiling"] = 1.0 / r["tax"]
        # The bytes alone, at the socket floor: what no framing, check or bookkeeping can undercut.
        r["floor_ms_per_tile"] = (
            r["mb_down_per_tile"] * floor["send_ms_per_mb"] + r["mb_up_per_tile"] * floor["recv_ms_per_mb"]
        )
        r["tax_floor"] = r["floor_ms_per_tile"] / gemm_ms
        r["over_floor"] = r["cpu_ms_per_tile"] / r["floor_ms_per_tile"]
    _say(
        args,
        f"  tile GEMM on one core: {gemm_ms:.1f} ms (median of {len(samples)}, {min(samples) * 1e3:.1f}-"
        f"{max(samples) * 1e3:.1f} ms)",
    )
    out: dict[str, Any] = {
        "shape": shape.name,
        "what": shape.what,
        "kind": shape.kind.value,
        "real_gemm": list(shape.real),
        "real_grid": list(shape.real_grid),
        "gemm": list(shape.gemm),
        "grid": list(shape.grid),
        "tile": list(shape.tile),
        "gemm_ms": gemm_ms,
        "gemm_ms_range": [1e3 * min(samples), 1e3 * max(samples)],
        "runs": {mode: _median(rs) for mode, rs in runs.items()},
    }
    if args.repeat > 1:
        out["every_run"] = runs
    tile, band = out["runs"].get("tile", {}), out["runs"].get("band", {})
    if "tax" in tile and "tax" in band:
        out["band_over_tile"] = {
            key: band[key] / tile[key] if tile[key] else None for key in ("tiles_per_s", "cpu_ms_per_tile", "tax")
        }
    return out


def send_threads_of(mode: str) -> int:
    """Send threads of a run's mode: ``band`` none (the loop sends), ``band+2s`` two."""
    _, _, n = mode.partition("+")
    return int(n.rstrip("s")) if n else 0


def render(result: dict[str, Any], console: Console) -> None:
    modes = list(dict.fromkeys(m for s in result["shapes"] for m in s["runs"]))
    both = len(modes) == 2
    table = Table(
        title=f"The coordinator's tax on Llama-2-7B tiles: float32, {result['devices']} replaying devices of "
        f"{result['slots']} slots, {result['seconds']:.0f} s a run"
        + (f", medians of {result['repeat']} runs each" if result["repeat"] > 1 else ""),
        title_justify="left",
    )
    table.add_column("figure")
    for mode in modes:
        table.add_column(f"{mode}", justify="right")
    if both:
        table.add_column(f"{modes[1]} / {modes[0]}", justify="right")

    def ms(x: float) -> str:
        return f"{x:.2f} ms"

    figures: list[tuple[str, str, Any]] = [  # label, key, format (None: no ratio)
        ("verified tiles per second", "tiles_per_s", lambda x: f"{x:,.1f}"),
        ("coordinator CPU per tile (every thread)", "cpu_ms_per_tile", ms),
        ("  verifier thread", "verify_ms_per_tile", ms),
        ("  event loop", "loop_ms_per_tile", ms),
        ("  send threads", "send_ms_per_tile", ms),
        ("  trainer thread (assembly, NaN check)", "trainer_ms_per_tile", ms),
        ("  other threads (torch's pool...)", "other_ms_per_tile", ms),
        ("the loop's ceiling: tiles / loop CPU second", "loop_ceiling_tiles_per_s", lambda x: f"{x:,.1f}"),
        ("tile GEMM on one core", "gemm_ms", ms),
        (f"tax: CPU per tile / GEMM (goal <= {GOAL_TAX:.0%})", "tax", lambda x: f"{x:.1%}"),
        ("ceiling: 1 / tax", "ceiling", lambda x: f"{x:.2f}x"),
        ("the tile's bytes at the socket floor", "floor_ms_per_tile", ms),
        ("tax floor: those bytes / GEMM", "tax_floor", lambda x: f"{x:.1%}"),
        ("CPU per tile / the floor's", "over_floor", lambda x: f"{x:.2f}x"),
        ("MB down per tile", "mb_down_per_tile", lambda x: f"{x:.2f}"),
        ("MB up per tile", "mb_up_per_tile", lambda x: f"{x:.2f}"),
        ("cores busy: coordinator", "coordinator_cores", lambda x: f"{x:.2f}"),
        ("cores busy: clients' process", "clients_cores", lambda x: f"{x:.2f}"),
    ]
    for s in result["shapes"]:
        m, n, k = s["tile"]
        table.add_row(
            f"[bold]{s['shape']}[/]: {s['what']}, tiles {m} x {n} x {k} "
            f"(here {'x'.join(map(str, s['gemm']))} cut {'x'.join(map(str, s['grid']))})",
            *([""] * (len(modes) + both)),
        )
        errors = [s["runs"].get(mode, {}).get("error") for mode in modes]
        if any(errors):
            table.add_row("[red]run failed[/]", *[f"[red]{e}[/]" if e else "" for e in errors], *([""] * both))
        for label, key, fmt in figures:
            values = [s["runs"].get(mode, {}).get(key) for mode in modes]
            cells = [fmt(v) if v is not None else "-" for v in values]
            if both:
                a, b = values
                cells.append(f"{b / a:.2f}x" if a and b is not None else "-")
            if all(v is None for v in values):
                continue
            table.add_row(label, *cells)
        table.add_section()
    console.print(table)
    console.print(
        "tax: the coordinator's CPU seconds per verified tile (every thread of its process) over that "
        "tile's GEMM on one core here; ceiling: the most any fleet can speed up GEMMs shipped in such "
        f"tiles. Goal: tax <= {GOAL_TAX:.0%} (a ceiling of {1 / GOAL_TAX:.0f}x). The clients replay their "
        "products (each computed once), so they cost little but their bytes; both processes share this "
        f"machine's cores. Socket floor (raw TCP on loopback, this process's CPU): "
        f"{result['socket_floor']['send_ms_per_mb']:.3f} ms a MB sent, "
        f"{result['socket_floor']['recv_ms_per_mb']:.3f} ms a MB received. "
        f"The coordinator ran {result['coordinator_threads']} torch threads; "
        f"{result['wall_s']:.0f} s in all.",
        style="dim",
    )


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM: clean up as Ctrl-C does (the clients' process and the temporary files go)."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--shapes",
        default=",".join(DEFAULT_SHAPES),
        help=f"comma-separated, of {', '.join(SHAPES)} (default: {','.join(DEFAULT_SHAPES)})",
    )
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="SHAPE=RxCxK",
        help="cut SHAPE's GEMM here into R x C x K cells of its real grid instead (e.g. q-dw=2x16x2; repeatable)",
    )
    p.add_argument(
        "--check",
        choices=("tile", "band", "both"),
        default="both",
        help="how results are checked: each alone, a row band at a time, or both in turn (default)",
    )
    p.add_argument(
        "--send-threads",
        type=int,
        nargs="+",
        default=[0],
        metavar="N",
        help="threads that write devices' sockets (0: the event loop; several: each in turn, default 0)",
    )
    p.add_argument("--devices", type=int, default=6, help="replaying devices, in one process (default: 6)")
    p.add_argument("--slots", type=int, default=2, help="tiles each device asks to hold (default: 2)")
    p.add_argument("--gemms", type=int, default=2, help="GEMMs in flight, each on its own operands (default: 2)")
    p.add_argument("--warmup", type=float, default=2.0, help="least seconds before measuring (default: 2)")
    p.add_argument("--warmup-timeout", type=float, default=60.0, help="seconds the warm-up may take at most")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds measured per shape and check (default: 10)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each check, alternating; medians shown (default: 1)")
    p.add_argument("--probation", type=int, default=2, help="verified tiles a new device's probation lasts")
    p.add_argument("--memory-mb", type=int, default=1024, help="block cache of each device (default: 1024)")
    p.add_argument("--join-timeout", type=float, default=60.0, help="seconds to wait for every device to join")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    # The clients' process (started by the bench itself).
    p.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)
    p.add_argument("--token", default=TOKEN, help=argparse.SUPPRESS)
    p.add_argument("--gflops", type=float, default=50.0, help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--summary", help=argparse.SUPPRESS)
    p.add_argument("--parent", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        return client_main(args)
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in SHAPES]
    if unknown or not names:
        p.error(f"unknown shapes {unknown}; choose among {', '.join(SHAPES)}")
    shapes = {name: SHAPES[name] for name in names}
    for spec in args.grid:
        name, _, cells = spec.partition("=")
        try:
            grid = tuple(int(x) for x in cells.lower().split("x"))
        except ValueError:
            grid = ()
        shape = SHAPES.get(name)
        if shape is None or len(grid) != 3 or not all(1 <= g <= r for g, r in zip(grid, shape.real_grid, strict=True)):
            p.error(f"--grid {spec}: want SHAPE=RxCxK with SHAPE one of {', '.join(SHAPES)}, within its real grid")
        if name in shapes:
            shapes[name] = dataclasses.replace(shape, grid=grid)
    if args.devices < 1 or not 1 <= args.slots <= 8 or args.gemms < 1 or args.seconds <= 0 or args.repeat < 1:
        p.error("need --devices >= 1, --slots 1 to 8, --gemms >= 1, --repeat >= 1 and --seconds > 0")
    checks = MODES if args.check == "both" else (args.check,)
    args.modes = tuple(f"{check}+{n}s" if n else check for n in args.send_threads for check in checks)
    args.gflops = {}
    for name in LOGGERS:  # the coordinator's warnings are collected per run and shown with its figures
        logging.getLogger(name).setLevel(logging.WARNING)
        logging.getLogger(name).propagate = False
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.perf_counter()
    args.floor = socket_floor()
    _say(
        args,
        f"socket floor on loopback: {args.floor['send_ms_per_mb']:.3f} ms of CPU a MB sent, "
        f"{args.floor['recv_ms_per_mb']:.3f} received",
    )
    with tempfile.TemporaryDirectory(prefix="cleave-bench-tax-") as tmp:
        rows = [run_shape(args, shape, Path(tmp)) for shape in shapes.values()]
    result = {
        "devices": args.devices,
        "slots": args.slots,
        "gemms_in_flight": args.gemms,
        "seconds": args.seconds,
        "repeat": args.repeat,
        "coordinator_threads": torch.get_num_threads(),
        "goal_tax": GOAL_TAX,
        "socket_floor": args.floor,
        "shapes": rows,
        "wall_s": time.perf_counter() - started,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render(result, Console(highlight=False))
    failed = [f"{s['shape']} {r['check']}" for s in rows for r in s["runs"].values() if "error" in r]
    if failed:
        print(f"FAILED: {', '.join(failed)} (see above)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
