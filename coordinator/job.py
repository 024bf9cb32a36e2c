"""One training job on a coordinator: store + core + websocket server + trainer thread.

``run_job`` is what ``cleave coordinator start`` calls. It serves until every step is done and
every device has been told the job is finished, then returns the step results.

A database that holds an unfinished job (its coordinator was killed or stopped) resumes it from
its newest good checkpoint; the steps after that checkpoint are computed again and, the state
being exact, give the same losses.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
from websockets.asyncio.server import serve

from coordinator import checkpoint
from coordinator.checkpoint import Resume
from coordinator.core import Core, FaultPolicy
from coordinator.server import MAX_FRAME, RemoteEngine, Server
from coordinator.tiles import TilingPolicy
from coordinator.training.data import load_corpus
from coordinator.training.loop import ConfigError, StepResult, TrainConfig, Trainer
from db.sqlite import SQLiteStore
from db.store import CheckpointRow


@dataclass(frozen=True)
class CoordinatorConfig:
    train: TrainConfig = field(default_factory=TrainConfig)
    host: str = "127.0.0.1"
    port: int = 8765
    db: str = "cleave.db"
    token: str | None = None
    metrics: str | None = None
    min_devices: int = 1
    policy: TilingPolicy = field(default_factory=TilingPolicy)
    faults: FaultPolicy = field(default_factory=FaultPolicy)
    checkpoint_every: int = 50  # steps; 0 turns checkpoints off
    new_job: bool = False  # start a new job even if the database holds an unfinished one

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise ValueError(f"--port must be between 0 and 65535, got {self.port}")
        if not (0 <= self.min_devices <= 100_000):
            raise ValueError(f"--min-devices must be between 0 and 100000, got {self.min_devices}")
        if self.token is not None and not self.token.strip():
            raise ValueError("--token must not be empty")
        if not (0 <= self.checkpoint_every <= 10_000_000):
            raise ValueError(f"--checkpoint-every must be between 0 and 10,000,000, got {self.checkpoint_every}")


@dataclass
class JobOutcome:
    results: list[StepResult]
    status: dict  # the final status snapshot: tiles, devices, traffic, verification cost
    url: str = ""
    resumed_from: int | None = None  # the checkpoint step a resumed job started from


class Reporter(Protocol):
    """What the job tells its operator; the CLI renders it."""

    def listening(self, url: str, token: str, generated: bool, join_url: str) -> None: ...
    def note(self, text: str) -> None: ...
    def waiting(self, have: int, want: int) -> None: ...
    def step(self, result: StepResult, status: dict) -> None: ...
    def finished(self, results: list[StepResult], status: dict) -> None: ...


def _public_url(host: str, port: int) -> str:
    """The address other machines should join: a wildcard bind is no address to connect to."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"ws://{host}:{port}"


def new_token() -> str:
    return secrets.token_urlsafe(16)


class _Metrics:
    """The --metrics JSONL file. A resumed job keeps the lines up to its checkpoint."""

    def __init__(self, path: str | None, keep_until: int | None = None) -> None:
        self.file = None
        if path is None:
            return
        kept: list[str] = []
        if keep_until is not None and Path(path).exists():
            for line in Path(path).read_text(encoding="utf-8").splitlines():
                try:
                    if json.loads(line).get("step", 0) <= keep_until:
                        kept.append(line)
                except (json.JSONDecodeError, AttributeError):
                    continue
        self.file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        for line in kept:
            self.file.write(line + "\n")

    def write(self, row: dict) -> None:
        if self.file is not None:
            self.file.write(metrics_line(row) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def metrics_line(row: dict) -> str:
    """One strict-JSON metrics line: a non-finite loss is written as null."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    return json.dumps(clean, sort_keys=True)


@dataclass
class _Plan:
    """What this start of the coordinator does: a new job, or the rest of an unfinished one."""

    job_id: int
    train: TrainConfig
    resume: Resume | None


def _plan(cfg: CoordinatorConfig, store: SQLiteStore, reporter: Reporter, now: float) -> _Plan:
    unfinished = None if cfg.new_job else store.resumable_job()
    # No tile in the database can be live now: the coordinator that made it is gone with its
    # operands. Whatever job runs next must never be handed one.
    abandoned = store.abandon_unfinished(None, now)
    store.mark_devices_offline("coordinator restarted")
    if unfinished is None:
        job_id = store.create_job(f"{cfg.train.model} x {cfg.train.steps} steps", cfg.train.to_dict(),
                                  cfg.train.steps, now)
        return _Plan(job_id, cfg.train, None)
    try:
        train = TrainConfig(**unfinished.config)
    except (TypeError, ConfigError) as exc:
        raise ConfigError(f"job {unfinished.id} in {cfg.db} cannot be resumed ({exc}); pass --new-job") from None
    resume = checkpoint.newest_good(store.checkpoints(unfinished.id))
    for why in resume.skipped:
        reporter.note(f"{why}; trying an older one")
    where = f"its checkpoint of step {resume.step}" if resume.state is not None else "the start (no usable checkpoint)"
    reporter.note(f"resuming job {unfinished.id} ({train.model}, {train.steps} steps, options as first given) "
                  f"from {where}; pass --new-job to start over instead")
    if abandoned:
        reporter.note(f"{abandoned} tiles in flight when the last coordinator stopped will be recomputed")
    store.truncate_steps(unfinished.id, resume.step)
    store.set_job_state(unfinished.id, "running", now)
    return _Plan(unfinished.id, train, resume)


async def serve_job(
    cfg: CoordinatorConfig,
    reporter: Reporter,
    *,
    clock: Callable[[], float] = time.time,
    ready: Callable[[str], None] | None = None,
    on_start: Callable[[Server], None] | None = None,
) -> JobOutcome:
    """Serve one job. ``ready(url)`` fires once listening; ``on_start(server)`` hands benchmarks
    and tests the live server (read it only from this event loop)."""
    loop = asyncio.get_running_loop()
    token, generated = (cfg.token, False) if cfg.token else (new_token(), True)
    store = SQLiteStore(cfg.db)
    metrics: _Metrics | None = None
    plan: _Plan | None = None
    results: list[StepResult] = []
    try:
        plan = _plan(cfg, store, reporter, clock())
        job_id, train_cfg = plan.job_id, plan.train
        corpus = await asyncio.to_thread(load_corpus, train_cfg.data)  # fail fast on bad --data
        # Verification vectors must be unpredictable to clients: OS entropy, never the public seed.
        core = Core(store, job_id, token=token, rng=np.random.default_rng(), policy=cfg.policy, faults=cfg.faults,
                    job_name=f"{train_cfg.model}, {train_cfg.steps} steps")
        start_step = plan.resume.step if plan.resume else 0
        core.progress.step = start_step
        server = Server(core, clock)
        if on_start is not None:
            on_start(server)
        metrics = _Metrics(cfg.metrics, keep_until=start_step if plan.resume else None)
        folder = checkpoint.checkpoint_dir(cfg.db)
        final: dict = {}
        url = ""
        started = 0.0  # set when training starts: waiting for devices is not training time
        tokens = 0

        def record(result: StepResult) -> None:  # on the loop: the single writer of store and metrics
            nonlocal tokens
            t = server.traffic
            extra = {"devices": len(core.devices), "mb_down": round(t.bytes_down / 1e6, 3),
                     "mb_up": round(t.bytes_up / 1e6, 3)}
            result = StepResult(result.step, result.loss, result.tokens, result.seconds, result.lr, extra)
            results.append(result)
            assert metrics is not None
            metrics.write(result.metrics())
            store.record_step(job_id, result.step, result.loss, result.tokens, result.seconds, clock(), extra)
            tokens += result.tokens
            elapsed = time.perf_counter() - started
            core.progress.loss = result.loss if math.isfinite(result.loss) else None
            core.progress.step = result.step
            core.progress.tokens_per_s = tokens / elapsed if elapsed > 0 else 0.0
            reporter.step(result, server.status())

        def saved(row: CheckpointRow) -> None:  # on the loop
            store.add_checkpoint(row)
            checkpoint.prune(store.checkpoints(job_id))

        def train() -> None:  # in the trainer thread
            trainer = Trainer(train_cfg, RemoteEngine(server, loop), corpus=corpus)
            if plan.resume is not None and plan.resume.state is not None:
                trainer.load_state_dict(plan.resume.state)
            while trainer.step < train_cfg.steps:
                result = trainer.train_step()
                loop.call_soon_threadsafe(record, result)
                every = cfg.checkpoint_every
                if (every and trainer.step % every == 0) or trainer.step == train_cfg.steps:
                    # Between steps, in the thread that owns the model: a consistent state.
                    row = checkpoint.save(folder, job_id, trainer.step, trainer.state_dict(), clock())
                    loop.call_soon_threadsafe(saved, row)

        async with serve(
            server.handler, cfg.host, cfg.port, compression=None, max_size=MAX_FRAME,
            ping_interval=20, ping_timeout=120, close_timeout=2,  # a frozen peer never answers a close
        ) as ws_server:
            ticker = asyncio.create_task(server.tick_forever())
            try:
                port = ws_server.sockets[0].getsockname()[1] if ws_server.sockets else cfg.port
                url = f"ws://{cfg.host}:{port}"
                reporter.listening(url, token, generated, _public_url(cfg.host, port))
                if ready is not None:
                    ready(url)
                core.progress.state = "waiting for devices"
                if start_step < train_cfg.steps:  # a job killed after its last step has nothing left
                    await server.wait_for_devices(cfg.min_devices, lambda have: reporter.waiting(have, cfg.min_devices))
                core.progress.state = "training"
                started = time.perf_counter()
                trainer = asyncio.ensure_future(asyncio.to_thread(train))
                try:
                    await asyncio.wait({trainer})  # waiting, unlike awaiting, leaves it running if we are cancelled
                    trainer.result()
                except BaseException:
                    server.abort("coordinator stopped")
                    # Let the trainer thread finish what it is doing (a checkpoint, say) and record
                    # it before the store closes; it stops at its next GEMM.
                    await asyncio.wait({trainer}, timeout=60)
                    raise
                store.set_job_state(job_id, "finished", clock())
                final = server.status()  # before the devices disconnect: their live counters
                server.deliver(core.finish(clock()))
                await server.close_all("job finished")
                final["job"]["state"] = "finished"
                reporter.finished(results, final)
            finally:
                ticker.cancel()
    except BaseException:
        if plan is not None:
            # Resumable if it trained at all (or was resumed); a start that failed before its
            # first step (bad --data, port in use) must not pin its options on the next start.
            trained = bool(results) or plan.resume is not None
            store.set_job_state(plan.job_id, "stopped" if trained else "failed", clock())
        raise
    finally:
        if metrics is not None:
            metrics.close()
        store.close()
    return JobOutcome(results, final, url, plan.resume.step if plan.resume else None)


def run_job(cfg: CoordinatorConfig, reporter: Reporter) -> JobOutcome:
    return asyncio.run(serve_job(cfg, reporter))

