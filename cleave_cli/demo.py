"""``cleave demo``: the quick start. A coordinator and local clients train the default model,
then the same job runs in plain torch and the losses are compared."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from cleave.cli import options as opt
from cleave.cli import render
from cleave.cli.errors import friendly, is_terminal
from cleave.cli.local import serve_with_local_clients
from cleave.cli.progress import ConsoleReporter
from cleave.coordinator.config import CoordinatorConfig
from cleave.coordinator.engine.identity import new_token
from cleave.coordinator.engine.live_plan import Planner
from cleave.coordinator.training.loop import TrainConfig, Trainer
from cleave.wire.errors import CleaveError, ConfigError

MATCH_TOLERANCE = 1e-4  # relative, per step


def max_relative_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True)), default=0.0)


@friendly
def demo(
    steps: opt.Steps = 100,
    clients: Annotated[int, typer.Option(help="Local client processes to start.")] = 2,
    model: opt.Model = "tiny",
    batch_size: opt.BatchSize = 8,
    seq_len: opt.SeqLen = 64,
    seed: opt.Seed = TrainConfig().seed,
    threads: Annotated[int, typer.Option(help="CPU threads per client.")] = 1,
    planner: Annotated[
        Planner,
        typer.Option(
            "--planner",
            case_sensitive=False,
            help="'uniform' (the demo's default) deals every GEMM to the clients as tiles, to show them at work; "
            "'cost' lets the cost model decide, and it keeps the tiny model's GEMMs on the coordinator, where "
            "they are cheaper than shipped.",
        ),
    ] = Planner.UNIFORM,
) -> None:
    """Train the default model on a coordinator with local clients, then compare with plain torch."""
    if not 1 <= clients <= 16:
        raise ConfigError(f"--clients must be between 1 and 16, got {clients}")
    console = Console(highlight=False)
    with opt.as_flags():
        train = TrainConfig(model=model, steps=steps, batch_size=batch_size, seq_len=seq_len, seed=seed)
    console.rule(f"[bold]cleave demo: {model} model, {steps} steps, {clients} clients, text = Python's stdlib")
    with tempfile.TemporaryDirectory(prefix="cleave-demo-") as tmp:
        cfg = CoordinatorConfig(
            train=train,
            port=0,
            db=str(Path(tmp) / "cleave.db"),
            token=new_token(),
            min_devices=clients,
            planner=planner,
        )
        reporter = ConsoleReporter(console, live=is_terminal())
        started = time.perf_counter()
        try:
            dist = asyncio.run(serve_with_local_clients(cfg, reporter, clients=clients, threads=threads)).results
        finally:
            reporter.close()
        dist_seconds = time.perf_counter() - started
    console.print("running the same job in plain torch for comparison ...", style="dim")
    started = time.perf_counter()
    local = Trainer(train).run()
    local_seconds = time.perf_counter() - started
    ours, theirs = [r.loss for r in dist], [r.loss for r in local]
    diff = max_relative_diff(ours, theirs)
    console.print(
        render.comparison(
            [
                ("first loss", ours[0], theirs[0]),
                ("final loss", ours[-1], theirs[-1]),
                ("wall time", f"{dist_seconds:.1f} s", f"{local_seconds:.1f} s"),
            ],
            diff,
            MATCH_TOLERANCE,
        )
    )
    if diff > MATCH_TOLERANCE:
        raise CleaveError(f"losses differ by {diff:.2e} (relative), more than {MATCH_TOLERANCE:g}")
