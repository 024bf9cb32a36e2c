"""``cleave train --local``: the same job in plain torch, the baseline to compare against."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console

from cleave.cli import options as opt
from cleave.cli import render
from cleave.cli.errors import friendly
from cleave.coordinator.job import metrics_line
from cleave.coordinator.training.hardware import coordinator_device, describe
from cleave.coordinator.training.loop import TrainConfig, Trainer
from cleave.wire.errors import ConfigError


@friendly
@opt.train_options
def train(
    local: Annotated[
        bool, typer.Option("--local", help="Train in this process with plain torch (the baseline).")
    ] = False,
    train: TrainConfig = TrainConfig(),  # the training options (opt.train_options)
    device: opt.Device = "auto",
    metrics: opt.Metrics = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only the final loss.")] = False,
) -> None:
    """Train locally with the coordinator's exact options, for a side-by-side comparison."""
    if not local:
        raise ConfigError("distributed training runs with `cleave coordinator start`; use --local for the baseline")
    console = Console(highlight=False)
    where = coordinator_device(device)
    trainer = Trainer(train, device=where)
    if not quiet:
        console.print(f"device: {describe(where)}")
    out = open(metrics, "w", encoding="utf-8") if metrics else None  # noqa: SIM115
    tokens = 0.0
    elapsed = 0.0
    evaluated: dict[str, Any] = {}  # the last held-out loss, as the status document names it
    try:
        for _ in range(train.steps):
            result = trainer.train_step()
            tokens += result.tokens
            elapsed += result.seconds
            val_loss = result.extra.get("val_loss")
            if "val_loss" in result.extra:
                evaluated = {"val_loss": val_loss, "val_step": result.step}
            if out is not None:
                out.write(metrics_line(result.metrics()) + "\n")
                out.flush()
            if not quiet:
                console.print(
                    render.step_line(
                        result.step, train.steps, result.loss, result.seconds, None, tokens / elapsed, val_loss=val_loss
                    ),
                    soft_wrap=True,
                )
    finally:
        if out is not None:
            out.close()
    held_out = render.held_out(evaluated, ", held-out {loss} (step {step})")
    console.print(f"done: {train.steps} steps, final loss {result.loss:.4f}{held_out}", style="bold green")
