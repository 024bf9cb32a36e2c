"""``cleave train --local``: the same job in plain torch, the baseline to compare against."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from cleave_cli import options as opt
from cleave_cli import render
from cleave_cli.errors import friendly
from coordinator.job import metrics_line
from coordinator.training.hardware import coordinator_device, describe
from coordinator.training.loop import TrainConfig, Trainer
from coordinator.wire.errors import ConfigError

D = TrainConfig()  # the defaults the options show


@friendly
def train(
    local: Annotated[
        bool, typer.Option("--local", help="Train in this process with plain torch (the baseline).")
    ] = False,
    model: opt.Model = D.model,
    steps: opt.Steps = D.steps,
    batch_size: opt.BatchSize = D.batch_size,
    seq_len: opt.SeqLen = D.seq_len,
    lr: opt.Lr = D.lr,
    seed: opt.Seed = D.seed,
    data: opt.Data = None,
    precision: opt.Precision = D.precision,
    micro_batches: opt.MicroBatches = "auto",
    device: opt.Device = "auto",
    metrics: opt.Metrics = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only the final loss.")] = False,
) -> None:
    """Train locally with the coordinator's exact options, for a side-by-side comparison."""
    if not local:
        raise ConfigError("distributed training runs with `cleave coordinator start`; use --local for the baseline")
    cfg = opt.train_config(model, steps, batch_size, seq_len, lr, seed, data, precision, micro_batches)
    console = Console(highlight=False)
    where = coordinator_device(device)
    trainer = Trainer(cfg, device=where)
    if not quiet:
        console.print(f"device: {describe(where)}")
    out = open(metrics, "w", encoding="utf-8") if metrics else None  # noqa: SIM115
    tokens = 0.0
    elapsed = 0.0
    try:
        for _ in range(cfg.steps):
            result = trainer.train_step()
            tokens += result.tokens
            elapsed += result.seconds
            if out is not None:
                out.write(metrics_line(result.metrics()) + "\n")
                out.flush()
            if not quiet:
                console.print(
                    render.step_line(result.step, cfg.steps, result.loss, result.seconds, None, tokens / elapsed),
                    soft_wrap=True,
                )
    finally:
        if out is not None:
            out.close()
    console.print(f"done: {cfg.steps} steps, final loss {result.loss:.4f}", style="bold green")
