"""One training job on a coordinator: store + core + websocket server + trainer thread.

``run_job`` is what ``cleave coordinator start`` calls. It serves until every step is done and
every device has been told the job is finished, then returns the step results.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
from websockets.asyncio.server import serve

from coordinator.core import Core
from coordinator.server import MAX_FRAME, RemoteEngine, Server
from coordinator.tiles import TilingPolicy
from coordinator.training.data import load_corpus
from coordinator.training.loop import StepResult, TrainConfig, Trainer
from db.sqlite import SQLiteStore


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

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise ValueError(f"--port must be between 0 and 65535, got {self.port}")
        if not (0 <= self.min_devices <= 100_000):
            raise ValueError(f"--min-devices must be between 0 and 100000, got {self.min_devices}")
        if self.token is not None and not self.token.strip():
            raise ValueError("--token must not be empty")


@dataclass
class JobOutcome:
    results: list[StepResult]
    status: dict  # the final status snapshot: tiles, devices, traffic, verification cost
    url: str = ""


class Reporter(Protocol):
    """What the job tells its operator; the CLI renders it."""

    def listening(self, url: str, token: str, generated: bool, join_url: str) -> None: ...
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
    def __init__(self, path: str | None) -> None:
        self.file = open(path, "w", encoding="utf-8") if path else None  # noqa: SIM115 - closed in close()

    def write(self, row: dict) -> None:
        if self.file is not None:
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
            self.file.write(json.dumps(clean, sort_keys=True) + "\n")  # strict JSON: a NaN loss is null
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


async def serve_job(
    cfg: CoordinatorConfig,
    reporter: Reporter,
    *,
    clock: Callable[[], float] = time.time,
    ready: Callable[[str], None] | None = None,
) -> JobOutcome:
    loop = asyncio.get_running_loop()
    token, generated = (cfg.token, False) if cfg.token else (new_token(), True)
    store = SQLiteStore(cfg.db)
    corpus = await asyncio.to_thread(load_corpus, cfg.train.data)  # fail fast on bad --data
    job_id = store.create_job(f"{cfg.train.model} x {cfg.train.steps} steps", cfg.train.to_dict(), cfg.train.steps, clock())
    # Verification vectors must be unpredictable to clients: OS entropy, never the public seed.
    core = Core(store, job_id, token=token, rng=np.random.default_rng(), policy=cfg.policy,
                job_name=f"{cfg.train.model}, {cfg.train.steps} steps")
    server = Server(core, clock)
    metrics = _Metrics(cfg.metrics)
    results: list[StepResult] = []
    final: dict = {}
    url = ""
    started = 0.0  # set when step 1 starts: waiting for devices is not training time
    tokens = 0

    def record(result: StepResult) -> None:  # on the loop: the single writer of store and metrics
        nonlocal tokens
        t = server.traffic
        extra = {"devices": len(core.devices), "mb_down": round(t.bytes_down / 1e6, 3), "mb_up": round(t.bytes_up / 1e6, 3)}
        result = StepResult(result.step, result.loss, result.tokens, result.seconds, result.lr, extra)
        results.append(result)
        metrics.write(result.metrics())
        loss = result.loss if math.isfinite(result.loss) else None
        store.record_step(job_id, result.step, result.loss, result.tokens, result.seconds, clock(), extra)
        tokens += result.tokens
        elapsed = time.perf_counter() - started
        core.progress.loss = loss
        core.progress.step = result.step
        core.progress.tokens_per_s = tokens / elapsed if elapsed > 0 else 0.0
        reporter.step(result, server.status())

    def on_step(result: StepResult) -> None:  # in the trainer thread: hand over to the loop
        loop.call_soon_threadsafe(record, result)

    def train() -> None:
        trainer = Trainer(cfg.train, RemoteEngine(server, loop), corpus=corpus)
        trainer.run(on_step)

    try:
        async with serve(
            server.handler, cfg.host, cfg.port, compression=None, max_size=MAX_FRAME,
            ping_interval=20, ping_timeout=120,
        ) as ws_server:
            port = ws_server.sockets[0].getsockname()[1] if ws_server.sockets else cfg.port
            url = f"ws://{cfg.host}:{port}"
            reporter.listening(url, token, generated, _public_url(cfg.host, port))
            if ready is not None:
                ready(url)
            core.progress.state = "waiting for devices"
            await server.wait_for_devices(cfg.min_devices, lambda have: reporter.waiting(have, cfg.min_devices))
            core.progress.state = "training"
            started = time.perf_counter()
            try:
                await asyncio.to_thread(train)
            except BaseException:
                server.abort("coordinator stopped")
                raise
            store.set_job_state(job_id, "finished", clock())
            final = server.status()  # before the devices disconnect: their live counters
            server.deliver(core.finish(clock()))
            await server.close_all("job finished")
            final["job"]["state"] = "finished"
            reporter.finished(results, final)
    except BaseException:
        store.set_job_state(job_id, "failed", clock())
        raise
    finally:
        metrics.close()
        store.close()
    return JobOutcome(results, final, url)


def run_job(cfg: CoordinatorConfig, reporter: Reporter) -> JobOutcome:
    return asyncio.run(serve_job(cfg, reporter))

