"""Benchmark: one Cleave training job on local client processes against plain torch, in one run.

Run from the repository root::

    .venv/bin/python bench/bench_distributed.py            # a table on stdout
    .venv/bin/python bench/bench_distributed.py --json     # one JSON object on stdout

Progress goes to stderr. Three phases run in the same process, one after the other:

1. the local baseline: ``Trainer`` in plain torch with ``--local-threads`` torch threads (by
   default every core of the machine, so the baseline uses the whole machine);
2. the distributed job: a coordinator (``serve_job``, same torch threads) and ``--clients``
   ``cleave join`` processes with ``--client-threads`` threads each, all on this machine;
3. a micro-benchmark of Freivalds' check on the tile shapes of the job's GEMMs.

The first ``--warmup-steps`` steps of both runs are skipped by every figure. The figures:

* **step time ratio**: mean distributed step time / mean local step time. 1.0 would mean the
  network, tiling and verification cost nothing; higher is slower.
* **client matmul share**: sum over clients of the seconds they report inside matmul (verified
  tiles only) / (distributed training wall time x number of clients). The rest of a client's
  wall time is waiting: for the coordinator (non-GEMM layers, optimizer, verification,
  assembly), for the wire, or for the other client.
* **traffic vs minimum**: real websocket frame bytes per step, coordinator -> clients ("down")
  and back ("up"), against the theoretical minimum where every GEMM ``C = A @ B``
  ``(m x k) @ (k x n)`` sends each operand once (``4 (mk + kn)`` bytes down) and returns its
  output once (``4 mn`` bytes up) in float32. Shapes come from the job's ``gemms`` table.
  Split-K weight gradients return one partial C per k-chunk, so "up" exceeds the minimum.
* **Freivalds cost / GEMM cost**, two ways:
  (a) in-run: the coordinator's seconds inside ``freivalds`` / the clients' matmul seconds, over
  the measured steps (the coordinator shares the cores with the clients, so this is noisy);
  (b) micro-benchmark: for every tile of one step (``plan_gemm`` with the job's device count
  and default policy, operands laid out as the trainer passes them), the median time of
  ``freivalds(a, b, c)`` / the median time of ``a @ b``, both with ``torch.set_num_threads(1)``
  and timed in turn, summed over the step's tiles. Also shown: the check's products
  ``|A(BR) - CR|`` alone (R: its n x 16 random vectors), without its tolerance norms and checks.

* **coordinator tile overhead**: the coordinator process's CPU seconds per step (event loop,
  trainer thread, verifier thread) minus what plain torch spends outside its GEMMs (its CPU per
  step minus the clients' matmul seconds, which stand for its GEMMs), over the clients' matmul
  seconds: what shipping GEMMs costs the PS in verification, framing, websockets, assembly,
  the store and scheduling, per second of GEMM the clients do.
* **wire floor**: what moving this step's bytes costs the machine's CPU with nothing else done
  (``wire_floor.py``: plain websockets on loopback, both ends, measured in this run), and the
  step ratio that leaves even if every other overhead were zero: plain torch's CPU per step
  plus that wire CPU, spread over every core, over plain torch's step time. A lower bound on
  figure 1 for this model, batch and wire dtype on this machine.
* **the demo**: ``cleave demo``'s job (tiny, batch 8 x 64, ``--demo-steps``, default 100) through
  ``--clients`` local clients with the demo's round-robin tiles and with the cost model, wall
  time over plain torch's, as the demo prints it (process starts and joins included); and,
  from the round-robin job's books, where a shipped GEMM's time goes (``gemm_round_trip``):
  the demo's step is a chain of small GEMMs, each waited for before the next.

The losses of both runs are also compared (they should agree to ~1e-4 relative).
"""

from __future__ import annotations

# isort: off
import cleave.cli  # noqa: F401  -- sets OMP_WAIT_POLICY=PASSIVE before torch is imported (2 cores!)
# isort: on

import argparse
import asyncio
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import wire_floor
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from timing import interleaved_medians

from cleave.cli.local import serve_with_local_clients
from cleave.cli.options import micro_batches_of
from cleave.coordinator.config import CoordinatorConfig
from cleave.coordinator.engine.identity import new_token
from cleave.coordinator.engine.live_plan import Planner
from cleave.coordinator.job import JobOutcome, Listening
from cleave.coordinator.planning.tiles import GemmKind, Tile, TilingPolicy, a_block, b_block, plan_gemm
from cleave.coordinator.training.loop import StepResult, TrainConfig, Trainer
from cleave.wire.messages import WireDtype
from cleave.wire.verify import ROUNDS, freivalds, random_vectors

WIRE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes per element on the wire
CLIENT_EXIT_TIMEOUT_S = 30.0
TABLE_WIDTH = 120


# ---------------------------------------------------------------------------- progress


class ProgressUI:
    """A rich progress bar per phase on a terminal; plain log lines on stderr otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.console = Console(stderr=True, highlight=False)
        self.enabled = enabled
        self.live = enabled and self.console.is_terminal
        self._progress: Progress | None = None
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._progress.start()

    def phase(self, description: str, total: int) -> TaskID | None:
        if self._progress is not None:
            return self._progress.add_task(description, total=total, info="")
        if self.enabled:
            self.console.print(f"{description} ...", style="dim")
        return None

    def advance(self, task: TaskID | None, info: str = "") -> None:
        if self._progress is not None and task is not None:
            self._progress.update(task, advance=1, info=info)
        elif self.enabled and info:
            self.console.print(f"  {info}", style="dim")

    def note(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, style="dim")
        elif self.enabled:
            self.console.print(text, style="dim")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


# ---------------------------------------------------------------------------- phase 1: local


@dataclass
class LocalRun:
    threads: int
    steps: list[StepResult]
    cpu_s: list[float]  # process CPU seconds of each step (every torch thread)


def run_local(train: TrainConfig, threads: int, ui: ProgressUI) -> LocalRun:
    torch.set_num_threads(threads)
    task = ui.phase(f"local torch ({threads} threads)", train.steps)
    trainer = Trainer(train)
    steps, cpu = [], []
    while trainer.step < train.steps:
        started = time.process_time()
        r = trainer.train_step()
        cpu.append(time.process_time() - started)
        steps.append(r)
        ui.advance(task, f"step {r.step}: {r.seconds * 1e3:.0f} ms, loss {r.loss:.4f}")
    return LocalRun(threads, steps, cpu)


# ---------------------------------------------------------------------------- phase 2: distributed


@dataclass(frozen=True)
class Snapshot:
    """Cumulative counters right after one step, taken on the coordinator's event loop."""

    step: int
    seconds: float
    loss: float
    mb_down: float  # real frame bytes, from StepResult.extra (rounded to 1 kB by the job)
    mb_up: float
    compute_s: float  # sum over live devices of client-reported matmul seconds
    verify_s: float  # coordinator seconds inside freivalds()
    cpu_s: float  # the coordinator process's CPU seconds so far (event loop, trainer, verifier)


def _snapshot(result: StepResult, status: dict[str, Any]) -> Snapshot:
    compute = sum(d["compute_s"] or 0.0 for d in status.get("devices", []))
    return Snapshot(
        step=result.step,
        seconds=result.seconds,
        loss=result.loss,
        mb_down=float(result.extra.get("mb_down", 0.0)),
        mb_up=float(result.extra.get("mb_up", 0.0)),
        compute_s=float(compute),
        verify_s=float(status["verify"]["seconds"]),
        cpu_s=time.process_time(),
    )


class BenchReporter:
    """The job's Reporter: records a snapshot per step and drives the progress bar.

    ``step`` runs on the event loop, queued by the trainer thread before it submits the next
    step's first GEMM, so each snapshot holds exactly the work of the steps done so far.
    """

    def __init__(self, ui: ProgressUI, steps: int) -> None:
        self.ui = ui
        self.steps = steps
        self.snapshots: list[Snapshot] = []
        self._task: TaskID | None = None
        self._started = False
        self.micro_batches = ""  # the job's note of the parts it cut each batch into

    def note(self, text: str) -> None:
        if text.startswith("micro-batches:"):
            self.micro_batches = text
            self.ui.note(text)

    def listening(self, info: Listening) -> None:
        self.ui.note(f"coordinator listening on {info.url}")

    def waiting(self, have: int, want: int) -> None:
        self.ui.note(f"waiting for clients: {have}/{want} joined")

    def step(self, result: StepResult, status: dict[str, Any]) -> None:
        if not self._started:
            self._started = True
            self._task = self.ui.phase("distributed", self.steps)
        self.snapshots.append(_snapshot(result, status))
        self.ui.advance(self._task, f"step {result.step}: {result.seconds * 1e3:.0f} ms, loss {result.loss:.4f}")

    def finished(self, results: list[StepResult], status: dict[str, Any]) -> None:
        pass


@dataclass
class DistributedRun:
    clients: int
    client_threads: int
    snapshots: list[Snapshot]
    outcome: JobOutcome
    gemms: list[tuple[int, str, int, int, int, int]]  # (step column, kind, m, n, k, tiles)
    micro_batches: str = ""  # what the job said of its micro-batches (auto: the cost model's choice)


def _read_gemms(db: Path) -> list[tuple[int, str, int, int, int, int]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT step, kind, m, n, k, tiles FROM gemms ORDER BY id").fetchall()
    return [(int(s), str(kind), int(m), int(n), int(k), int(t)) for s, kind, m, n, k, t in rows]


def run_distributed(
    train: TrainConfig,
    threads: int,
    clients: int,
    client_threads: int,
    ui: ProgressUI,
    wire_dtype: WireDtype = WireDtype.FP32,
    band_checks: bool = True,
) -> DistributedRun:
    torch.set_num_threads(threads)
    reporter = BenchReporter(ui, train.steps)
    with tempfile.TemporaryDirectory(prefix="cleave-bench-") as tmp:
        db = Path(tmp) / "bench.db"
        cfg = CoordinatorConfig(
            train=train,
            port=0,
            db=str(db),
            token=new_token(),
            min_devices=clients,
            planner=Planner.UNIFORM,  # its micro-benchmark re-plans the fixed grid
            wire_dtype=wire_dtype,
            band_checks=band_checks,
        )
        outcome = asyncio.run(
            serve_with_local_clients(
                cfg,
                reporter,
                clients=clients,
                threads=client_threads,
                name="bench",
                exit_timeout=CLIENT_EXIT_TIMEOUT_S,
                quiet_clients=True,
            )
        )
        gemms = _read_gemms(db)
    return DistributedRun(clients, client_threads, reporter.snapshots, outcome, gemms, reporter.micro_batches)


# ---------------------------------------------------------------------------- phase 3: Freivalds micro-benchmark


@dataclass(frozen=True)
class TileShape:
    kind: str
    rows: int
    cols: int
    ks: int


@dataclass
class TileTiming:
    shape: TileShape
    per_step: int  # how many tiles of this shape one training step has
    matmul_s: float  # median seconds of one a @ b
    verify_s: float  # median seconds of one freivalds(a, b, c)
    products_s: float  # median seconds of its products alone, |A(Br) - Cr|, without the tolerance

    @property
    def ratio(self) -> float:
        return self.verify_s / self.matmul_s if self.matmul_s else 0.0


def _operands(kind: GemmKind, m: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``a (m x k)`` and ``b (k x n)`` with the memory layout ``TiledLinear`` gives the engine."""

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    if kind is GemmKind.FORWARD:  # X @ W^T: W stored (out x in)
        return randn(m, k), randn(n, k).t()
    if kind is GemmKind.GRAD_WEIGHT:  # dY^T @ X: dY stored (tokens x out)
        return randn(k, m).t(), randn(k, n)
    return randn(m, k), randn(k, n)  # dX = dY @ W, plain


def micro_benchmark(
    step_gemms: list[tuple[str, int, int, int, int]],
    devices: int,
    repeats: int,
    ui: ProgressUI,
) -> list[TileTiming]:
    """Time matmul and Freivalds on every distinct tile of one step's GEMMs, one thread.

    ``step_gemms`` holds ``(kind, m, n, k, tiles)`` rows of the job's ``gemms`` table; the tiles
    are re-planned here as the coordinator planned them (same policy, same device count).
    """
    policy = TilingPolicy()
    gemm_counts = Counter(step_gemms)
    tiles_per_step: Counter[TileShape] = Counter()
    example: dict[TileShape, tuple[str, int, int, int, Tile]] = {}
    for (kind, m, n, k, stored), count in gemm_counts.items():
        tiles = plan_gemm(m, n, k, GemmKind(kind), devices, policy).tiles
        if len(tiles) != stored:
            raise RuntimeError(f"re-planned {kind} {m}x{k}@{k}x{n} into {len(tiles)} tiles, the job used {stored}")
        for t in tiles:
            shape = TileShape(kind, t.r1 - t.r0, t.c1 - t.c0, t.k1 - t.k0)
            tiles_per_step[shape] += count
            example.setdefault(shape, (kind, m, n, k, t))
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    task = ui.phase("Freivalds micro-benchmark (1 thread)", len(example))
    out = []
    try:
        for shape, (kind, m, n, k, tile) in sorted(
            example.items(), key=lambda kv: (kv[0].kind, -kv[0].rows * kv[0].cols * kv[0].ks)
        ):
            a, b = _operands(GemmKind(kind), m, n, k, gen)
            ab, bb = a_block(a, tile), b_block(b, tile)
            c = ab @ bb
            r = random_vectors(shape.cols, ROUNDS, rng)  # the check's n x 16 vectors
            matmul_s, verify_s, products_s = interleaved_medians(
                [lambda: ab @ bb, lambda: freivalds(ab, bb, c, rng), lambda: (ab @ (bb @ r) - c @ r).abs()],  # noqa: B023 - timed here
                repeats,
            )
            if not freivalds(ab, bb, c, rng).ok:
                raise RuntimeError(f"an honest tile {shape} failed Freivalds' check")
            out.append(TileTiming(shape, tiles_per_step[shape], matmul_s, verify_s, products_s))
            ui.advance(task, f"{kind} {shape.rows}x{shape.ks}@{shape.ks}x{shape.cols}: {verify_s / matmul_s:.1%}")
    finally:
        torch.set_num_threads(previous)
    return out


# ---------------------------------------------------------------------------- figures


@dataclass
class Figures:
    config: dict[str, Any]
    step_time: dict[str, Any]
    client_matmul_share: dict[str, Any]
    traffic: dict[str, Any]
    verify: dict[str, Any]
    loss: dict[str, Any]
    coordinator: dict[str, Any]
    demo: dict[str, Any] | None
    wire_floor: dict[str, Any] | None = None
    tiles: list[dict[str, Any]] = field(default_factory=list)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _gemm_step_offset(gemms: list[tuple[int, str, int, int, int, int]], steps: int) -> int:
    """The job stores the last *completed* step with each GEMM, so training step s carries s - 1.

    Checked rather than assumed: the column must take exactly ``steps`` consecutive values, each
    on the same number of GEMMs (every step runs the same GEMMs).
    """
    counts = Counter(g[0] for g in gemms)
    values = sorted(counts)
    if not values or values != list(range(values[0], values[0] + steps)) or len(set(counts.values())) != 1:
        raise RuntimeError(f"gemms.step holds {dict(counts)}: expected {steps} consecutive steps of equal size")
    return 1 - values[0]


def compute_figures(
    args: argparse.Namespace,
    local: LocalRun,
    dist: DistributedRun,
    timings: list[TileTiming],
    demo: dict[str, Any] | None = None,
    wire: dict[str, Any] | None = None,
) -> Figures:
    warm = args.warmup_steps
    measured = args.steps - warm

    local_s = [r.seconds for r in local.steps[warm:]]
    snaps = dist.snapshots
    dist_s = [s.seconds for s in snaps[warm:]]
    first, last = (snaps[warm - 1] if warm else None), snaps[-1]

    def delta(attr: str) -> float:
        return getattr(last, attr) - (getattr(first, attr) if first is not None else 0.0)

    wall = sum(dist_s)
    compute = delta("compute_s")
    verify_s = delta("verify_s")

    offset = _gemm_step_offset(dist.gemms, args.steps)
    window = [g for g in dist.gemms if g[0] + offset > warm]
    size = WIRE_BYTES[args.wire_dtype]
    min_down = sum(size * (m * k + k * n) for _, _, m, n, k, _ in window) / measured
    min_up = sum(size * m * n for _, _, m, n, k, _ in window) / measured
    real_down = delta("mb_down") * 1e6 / measured
    real_up = delta("mb_up") * 1e6 / measured

    micro_matmul = sum(t.matmul_s * t.per_step for t in timings)
    micro_verify = sum(t.verify_s * t.per_step for t in timings)
    micro_products = sum(t.products_s * t.per_step for t in timings)

    # The coordinator's CPU beyond what plain torch spends outside its GEMMs (the PS's own
    # non-GEMM work, which both runs do): verification, framing, websockets, assembly, the
    # store, scheduling. Plain torch's GEMM CPU is taken as the clients' matmul seconds (the same
    # FLOPs on one thread each; smaller tiles run a little slower, so this errs high).
    coord_cpu = delta("cpu_s") / measured
    local_cpu = _mean(local.cpu_s[warm:])
    matmul = compute / measured
    overhead = coord_cpu - max(0.0, local_cpu - matmul)

    floor: dict[str, Any] | None = None
    if wire is not None:
        cores = os.cpu_count() or 1
        wire_cpu = (real_down + real_up) * wire["cpu_s_per_gb"] / 1e9
        local_wall = _mean(local_s)
        floor_wall = max(local_wall, (local_cpu + wire_cpu) / cores)
        floor = {
            **wire,
            "cores": cores,
            "wire_cpu_s_per_step": wire_cpu,
            "local_cpu_s_per_step": local_cpu,
            "floor_step_s": floor_wall,
            "floor_ratio": floor_wall / local_wall,
        }

    d_loss, l_loss = [s.loss for s in snaps], [r.loss for r in local.steps]
    rel = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(d_loss, l_loss, strict=True))

    status = dist.outcome.status
    return Figures(
        config={
            "model": args.model,
            "steps": args.steps,
            "warmup_steps": warm,
            "measured_steps": measured,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "tokens_per_step": args.batch_size * args.seq_len,
            "clients": dist.clients,
            "client_threads": dist.client_threads,
            "local_threads": local.threads,
            "coordinator_threads": args.coordinator_threads or local.threads,
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "wire_dtype": args.wire_dtype,
            "micro_batches": args.micro_batches,
            "micro_batches_chosen": dist.micro_batches,
            "gemms_per_step": len(window) // measured,
            "tiles_per_step": sum(t.per_step for t in timings),
        },
        step_time={
            "local_s": _mean(local_s),
            "distributed_s": _mean(dist_s),
            "ratio": _mean(dist_s) / _mean(local_s),
            "local_steps_s": [r.seconds for r in local.steps],
            "distributed_steps_s": [s.seconds for s in snaps],
        },
        client_matmul_share={
            "compute_s": compute,
            "wall_s": wall,
            "clients": dist.clients,
            "share": compute / (wall * dist.clients) if wall else 0.0,
        },
        traffic={
            "down_bytes_per_step": real_down,
            "up_bytes_per_step": real_up,
            "min_down_bytes_per_step": min_down,
            "min_up_bytes_per_step": min_up,
            "down_ratio": real_down / min_down,
            "up_ratio": real_up / min_up,
            "total_ratio": (real_down + real_up) / (min_down + min_up),
            "job_total_mb_down": status["traffic"]["mb_down"],
            "job_total_mb_up": status["traffic"]["mb_up"],
        },
        verify={
            "in_run": {
                "verify_s": verify_s,
                "compute_s": compute,
                "ratio": verify_s / compute if compute else 0.0,
                "worst_honest_ratio": status["verify"]["worst_honest_ratio"],
                "tiles_rejected": status["tiles"]["rejected"],
            },
            "micro": {
                "verify_s_per_step": micro_verify,
                "matmul_s_per_step": micro_matmul,
                "ratio": micro_verify / micro_matmul if micro_matmul else 0.0,
                "products_s_per_step": micro_products,
                "products_ratio": micro_products / micro_matmul if micro_matmul else 0.0,
                "repeats": args.micro_repeats,
                "threads": 1,
            },
        },
        loss={"local_final": l_loss[-1], "distributed_final": d_loss[-1], "max_relative_diff": rel},
        coordinator={
            "cpu_s_per_step": coord_cpu,
            "local_cpu_s_per_step": local_cpu,
            "client_matmul_s_per_step": matmul,
            "overhead_s_per_step": overhead,
            "overhead_ratio": overhead / matmul if matmul else 0.0,
        },
        demo=demo,
        wire_floor=floor,
        tiles=[
            {
                **asdict(t.shape),
                "per_step": t.per_step,
                "matmul_s": t.matmul_s,
                "verify_s": t.verify_s,
                "products_s": t.products_s,
                "ratio": t.ratio,
            }
            for t in timings
        ],
    )


# ---------------------------------------------------------------------------- phase 4: the demo


def run_demo(steps: int, clients: int, ui: ProgressUI, micro_batches: int = 1) -> dict[str, Any]:
    """``cleave demo``'s job (tiny, batch 8 x 64): its wall time through local clients, with the
    demo's round-robin tiles and with the cost model, against plain torch, as the demo reports."""
    train = TrainConfig(model="tiny", steps=steps, batch_size=8, seq_len=64, micro_batches=micro_batches)
    out: dict[str, Any] = {"steps": steps, "clients": clients}
    for planner in (Planner.UNIFORM, Planner.COST):
        task = ui.phase(f"demo job, --planner {planner.value}", 1)
        with tempfile.TemporaryDirectory(prefix="cleave-bench-demo-") as tmp:
            cfg = CoordinatorConfig(
                train=train,
                port=0,
                db=str(Path(tmp) / "demo.db"),
                token=new_token(),
                min_devices=clients,
                planner=planner,
            )
            started = time.perf_counter()
            outcome = asyncio.run(
                serve_with_local_clients(
                    cfg,
                    BenchReporter(ui, steps),
                    clients=clients,
                    threads=1,
                    name="demo",
                    exit_timeout=CLIENT_EXIT_TIMEOUT_S,
                    quiet_clients=True,
                )
            )
            wall = time.perf_counter() - started
            with sqlite3.connect(Path(tmp) / "demo.db") as conn:
                tiles = int(conn.execute("SELECT COALESCE(SUM(tiles), 0) FROM gemms").fetchone()[0])
                round_trip = gemm_round_trip(conn)
        out[planner.value] = {
            "wall_s": wall,
            "train_s": sum(r.seconds for r in outcome.results),
            "tiles": tiles,
            "final_loss": outcome.results[-1].loss,
            "gemm_ms": round_trip,
        }
        ui.advance(task, f"{wall:.1f} s, {tiles} tiles")
    task = ui.phase("demo job, plain torch", 1)
    started = time.perf_counter()
    local = Trainer(train).run()
    out["local"] = {"wall_s": time.perf_counter() - started, "final_loss": local[-1].loss}
    ui.advance(task, f"{out['local']['wall_s']:.1f} s")
    for planner in (Planner.UNIFORM, Planner.COST):
        out[planner.value]["ratio"] = out[planner.value]["wall_s"] / out["local"]["wall_s"]
    return out


def gemm_round_trip(conn: sqlite3.Connection) -> dict[str, float] | None:
    """Where the demo's step goes, from the job's books (medians over the GEMMs of the second
    half of the job, whose tiles went out): ``gemm`` ms from a GEMM's submission to its last
    verified tile (its planning, store rows and work frames, the wire both ways, the clients'
    compute, the check; the books take one clock reading per event-loop turn, so they cannot
    split these), ``trainer`` ms from a GEMM done to the next one's submission within a step
    (the PS's own ops and the trainer thread's hand-offs), and ``gemms_per_step``."""
    rows = conn.execute(
        """SELECT g.id, g.step, g.created_at, g.done_at
           FROM gemms g WHERE g.done_at IS NOT NULL AND g.tiles > 0 ORDER BY g.id"""
    ).fetchall()
    rows = rows[len(rows) // 2 :]
    if len(rows) < 2:
        return None
    ms = 1e3
    trainer = [b[2] - a[3] for a, b in zip(rows, rows[1:]) if b[1] == a[1] and b[2] >= a[3]]
    return {
        "gemm": ms * statistics.median(r[3] - r[2] for r in rows),
        "trainer": ms * statistics.median(trainer) if trainer else float("nan"),
        "gemms_per_step": len(rows) / len({r[1] for r in rows}),
    }


# ---------------------------------------------------------------------------- output


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.2f} MB"


def render(fig: Figures, console: Console, show_tiles: bool) -> None:
    c, st, cs, tr, vf = fig.config, fig.step_time, fig.client_matmul_share, fig.traffic, fig.verify
    title = (
        f"Cleave distributed vs local: {c['model']} model, batch {c['batch_size']} x seq {c['seq_len']}, "
        f"{c['measured_steps']} measured steps after {c['warmup_steps']} warm-up"
    )
    table = Table(title=title, title_justify="left", show_lines=True)
    table.add_column("figure")
    table.add_column("measured", justify="right")
    table.add_column("reference", justify="right")
    table.add_column("ratio", justify="right", style="bold")
    table.add_row(
        f"1. step time\n   {c['clients']} clients x {c['client_threads']} thr / torch x {c['local_threads']} thr",
        f"{st['distributed_s'] * 1e3:,.0f} ms",
        f"{st['local_s'] * 1e3:,.0f} ms",
        f"{st['ratio']:.2f}x",
    )
    if fig.wire_floor is not None:
        wf = fig.wire_floor
        table.add_row(
            "1b. wire floor: CPU to move this step's\n    bytes alone (websockets, loopback)",
            f"{wf['wire_cpu_s_per_step'] * 1e3:,.0f} ms",
            f"{wf['local_cpu_s_per_step'] * 1e3:,.0f} ms",
            f"{wf['cpu_s_per_gb']:.2f} s/GB",
        )
        table.add_row(
            f"    step ratio left if nothing else cost:\n    (torch CPU + wire CPU) / {wf['cores']} cores",
            f"{wf['floor_step_s'] * 1e3:,.0f} ms",
            f"{st['local_s'] * 1e3:,.0f} ms",
            f"{wf['floor_ratio']:.2f}x",
        )
    table.add_row(
        "2. client time in matmul\n   compute_s / (wall x clients)",
        f"{cs['compute_s']:.2f} s",
        f"{cs['wall_s']:.2f} s x {cs['clients']}",
        f"{cs['share']:.1%}",
    )
    table.add_row(
        "3. bytes/step down\n   frames / sum 4(mk + kn)",
        _mb(tr["down_bytes_per_step"]),
        _mb(tr["min_down_bytes_per_step"]),
        f"{tr['down_ratio']:.2f}x",
    )
    table.add_row(
        "   bytes/step up\n   frames / sum 4mn",
        _mb(tr["up_bytes_per_step"]),
        _mb(tr["min_up_bytes_per_step"]),
        f"{tr['up_ratio']:.2f}x",
    )
    table.add_row(
        "   bytes/step, both ways",
        _mb(tr["down_bytes_per_step"] + tr["up_bytes_per_step"]),
        _mb(tr["min_down_bytes_per_step"] + tr["min_up_bytes_per_step"]),
        f"{tr['total_ratio']:.2f}x",
    )
    table.add_row(
        "4a. Freivalds, in run\n    verify s / client matmul s",
        f"{vf['in_run']['verify_s']:.3f} s",
        f"{vf['in_run']['compute_s']:.2f} s",
        f"{vf['in_run']['ratio']:.1%}",
    )
    table.add_row(
        f"4b. Freivalds, micro-bench\n    {c['tiles_per_step']} tiles/step, 1 thread",
        f"{vf['micro']['verify_s_per_step'] * 1e3:.1f} ms",
        f"{vf['micro']['matmul_s_per_step'] * 1e3:.1f} ms",
        f"{vf['micro']['ratio']:.1%}",
    )
    table.add_row(
        "    its products |A(BR) - CR|\n    alone (R: n x 16; no norms)",
        f"{vf['micro']['products_s_per_step'] * 1e3:.1f} ms",
        f"{vf['micro']['matmul_s_per_step'] * 1e3:.1f} ms",
        f"{vf['micro']['products_ratio']:.1%}",
    )
    co = fig.coordinator
    table.add_row(
        "5. coordinator tile overhead\n   CPU beyond plain torch's non-GEMM / client matmul",
        f"{co['overhead_s_per_step'] * 1e3:,.0f} ms",
        f"{co['client_matmul_s_per_step'] * 1e3:,.0f} ms",
        f"{co['overhead_ratio']:.1%}",
    )
    table.add_row(
        "   coordinator CPU per step\n   (plain torch's whole step)",
        f"{co['cpu_s_per_step'] * 1e3:,.0f} ms",
        f"{co['local_cpu_s_per_step'] * 1e3:,.0f} ms",
        f"{co['cpu_s_per_step'] / co['local_cpu_s_per_step']:.2f}x" if co["local_cpu_s_per_step"] else "-",
    )
    if fig.demo is not None:
        dm = fig.demo
        for planner in ("uniform", "cost"):
            table.add_row(
                f"6. cleave demo, --planner {planner}\n   tiny, {dm['steps']} steps: wall / plain torch",
                f"{dm[planner]['wall_s']:.1f} s ({dm[planner]['tiles']:,} tiles)",
                f"{dm['local']['wall_s']:.1f} s",
                f"{dm[planner]['ratio']:.2f}x",
            )
        rt = dm["uniform"].get("gemm_ms")
        if rt is not None:
            table.add_row(
                "   round-robin: a GEMM submitted to done;\n   the trainer between two GEMMs (medians)",
                f"{rt['gemm']:.1f} ms",
                f"{rt['trainer']:.1f} ms",
                f"{rt['gemms_per_step']:.0f} GEMMs a step",
            )
    console.print(table)
    if show_tiles:
        tiles = Table(title="Freivalds micro-benchmark per tile shape (1 thread, medians)", title_justify="left")
        for name, justify in (
            ("kind", "left"),
            ("tile A @ B", "left"),
            ("tiles/step", "right"),
            ("a @ b", "right"),
            ("freivalds", "right"),
            ("ratio", "right"),
            ("products only", "right"),
            ("ratio", "right"),
        ):
            tiles.add_column(name, justify=justify)  # type: ignore[arg-type]
        for t in fig.tiles:
            tiles.add_row(
                t["kind"],
                f"{t['rows']}x{t['ks']} @ {t['ks']}x{t['cols']}",
                str(t["per_step"]),
                f"{t['matmul_s'] * 1e3:.2f} ms",
                f"{t['verify_s'] * 1e3:.3f} ms",
                f"{t['ratio']:.1%}",
                f"{t['products_s'] * 1e3:.3f} ms",
                f"{t['products_s'] / t['matmul_s']:.1%}",
            )
        console.print(tiles)
    lo = fig.loss
    console.print(
        f"plain torch ran with {c['local_threads']} torch threads ({c['cpu_count']} cores); "
        f"the coordinator process used "
        f"{c['coordinator_threads']} and shares those cores with the {c['clients']} clients. "
        f"{c['gemms_per_step']} GEMMs and {c['tiles_per_step']} tiles per step. "
        f"Final loss {lo['distributed_final']:.4f} distributed vs {lo['local_final']:.4f} local "
        f"(max relative difference {lo['max_relative_diff']:.1e}); "
        f"{vf['in_run']['tiles_rejected']} tiles rejected, worst honest residual "
        f"{vf['in_run']['worst_honest_ratio']:.3f} of the tolerance.",
        style="dim",
    )


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--model", default="small", help="model preset (default: small, ~11M parameters)")
    p.add_argument("--steps", type=int, default=6, help="training steps per run, warm-up included (default: 6)")
    p.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of every figure (default: 2)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=TrainConfig().seed)
    p.add_argument(
        "--micro-batches",
        default="auto",
        help="the coordinator's --micro-batches, for the job and the demo (default: auto, as cleave runs it; "
        "plain torch always takes the whole batch)",
    )
    p.add_argument("--clients", type=int, default=2, help="local client processes (default: 2)")
    p.add_argument("--client-threads", type=int, default=1, help="torch threads per client (default: 1)")
    p.add_argument(
        "--local-threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads of the plain-torch baseline and of the coordinator (default: all cores)",
    )
    p.add_argument(
        "--coordinator-threads", type=int, default=0, help="torch threads of the coordinator (default: --local-threads)"
    )
    p.add_argument("--micro-repeats", type=int, default=7, help="timed repeats per tile shape (default: 7)")
    p.add_argument(
        "--demo-steps",
        type=int,
        default=100,
        help="steps of the demo job timed last (cleave demo's default: 100; 0 skips it)",
    )
    p.add_argument(
        "--checks",
        choices=["band", "tile"],
        default="band",
        help="how the coordinator checks results: a row band at a time (default) or each alone",
    )
    p.add_argument(
        "--wire-dtype",
        choices=[w.value for w in WireDtype],
        default=WireDtype.FP32.value,
        help="the distributed job's --wire-dtype (default: fp32, exact)",
    )
    p.add_argument("--wire-mb", type=int, default=256, help="MB each way for the wire floor (default: 256; 0 skips it)")
    p.add_argument("--tiles", action="store_true", help="also print the micro-benchmark per tile shape")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of tables")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)
    if args.steps <= args.warmup_steps or args.warmup_steps < 0:
        p.error("need 0 <= --warmup-steps < --steps")
    if not 1 <= args.clients <= 16:
        p.error("--clients must be between 1 and 16")
    if args.wire_mb < 0:
        p.error("--wire-mb must be >= 0")
    if (
        args.client_threads < 1
        or args.local_threads < 1
        or args.micro_repeats < 1
        or args.demo_steps < 0
        or args.coordinator_threads < 0
    ):
        p.error("--client-threads, --local-threads and --micro-repeats must be >= 1, --demo-steps >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    train = TrainConfig(
        model=args.model,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        seed=args.seed,
        micro_batches=micro_batches_of(args.micro_batches),
    )
    ui = ProgressUI(enabled=not args.quiet)
    try:
        local = run_local(train, args.local_threads, ui)
        dist = run_distributed(
            train,
            args.coordinator_threads or args.local_threads,
            args.clients,
            args.client_threads,
            ui,
            WireDtype(args.wire_dtype),
            band_checks=args.checks == "band",
        )
        offset = _gemm_step_offset(dist.gemms, args.steps)
        last_step = [(kind, m, n, k, tiles) for s, kind, m, n, k, tiles in dist.gemms if s + offset == args.steps]
        timings = micro_benchmark(last_step, args.clients, args.micro_repeats, ui)
        demo = (
            run_demo(args.demo_steps, args.clients, ui, micro_batches_of(args.micro_batches))
            if args.demo_steps > 0
            else None
        )
        wire = None
        if args.wire_mb > 0:
            task = ui.phase("wire floor: plain websockets on loopback", 1)
            wire = wire_floor.measure(args.wire_mb)
            ui.advance(task, f"{wire['cpu_s_per_gb']:.2f} CPU s/GB")
    finally:
        ui.close()
    figures = compute_figures(args, local, dist, timings, demo, wire)
    if args.json:
        print(json.dumps(asdict(figures), indent=2))
    else:
        console = Console(highlight=False)
        if not console.is_terminal:
            console = Console(highlight=False, width=TABLE_WIDTH)  # rich would wrap a file or pipe at 80
        render(figures, console, args.tiles)
    return 0


if __name__ == "__main__":
    sys.exit(main())
