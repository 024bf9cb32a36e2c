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
    warmup: opt.Warmup = D.warmup,
    min_lr: opt.MinLr = D.min_lr,
    weight_decay: opt.WeightDecay = D.weight_decay,
    grad_clip: opt.GradClip = D.grad_clip,
    seed: opt.Seed = D.seed,
    data: opt.Data = None,
    data_field: opt.DataField = D.data_field,
    data_dtype: opt.DataDtype = None,
    vocab_size: opt.VocabSize = 0,
    val_data: opt.ValData = None,
    val_fraction: opt.ValFraction = D.val_fraction,
    eval_every: opt.EvalEvery = D.eval_every,
    eval_batches: opt.EvalBatches = D.eval_batches,
    precision: opt.Precision = D.precision,
    micro_batches: opt.MicroBatches = "auto",
    device: opt.Device = "auto",
    metrics: opt.Metrics = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only the final loss.")] = False,
) -> None:
    """Train locally with the coordinator's exact options, for a side-by-side comparison."""
    if not local:
        raise ConfigError("distributed training runs with `cleave coordinator start`; use --local for the baseline")
    cfg = opt.train_config(
        model,
        steps,
        batch_size,
        seq_len,
        lr,
        seed,
        data,
        precision,
        micro_batches,
        warmup=warmup,
        min_lr=min_lr,
        weight_decay=weight_decay,
        grad_clip=grad_clip,
        data_field=data_field,
        data_dtype=data_dtype,
        vocab_size=vocab_size,
        val_data=val_data,
        val_fraction=val_fraction,
        eval_every=eval_every,
        eval_batches=eval_batches,
    )
    console = Console(highlight=False)
    where = coordinator_device(device)
    trainer = Trainer(cfg, device=where)
    if not quiet:
        console.print(f"device: {describe(where)}")
    out = open(metrics, "w", encoding="utf-8") if metrics else None  # noqa: SIM115
    tokens = 0.0
    elapsed = 0.0
    evaluated: dict[str, Any] = {}  # the last held-out loss, as the status document names it
    try:
        for _ in range(cfg.steps):
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
                        result.step, cfg.steps, result.loss, result.seconds, None, tokens / elapsed, val_loss=val_loss
                    ),
                    soft_wrap=True,
                )
    finally:
        if out is not None:
            out.close()
    held_out = render.held_out(evaluated, ", held-out {loss} (step {step})")
    console.print(f"done: {cfg.steps} steps, final loss {result.loss:.4f}{held_out}", style="bold green")
