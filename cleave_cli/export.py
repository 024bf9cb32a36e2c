"""``cleave export``: a job's checkpoint written as a folder transformers loads."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from cleave.cli import options as opt
from cleave.cli.errors import friendly
from cleave.coordinator.training.export import export_job
from cleave.wire.errors import ConfigError


@friendly
def export(
    out: Annotated[
        Path, typer.Option("--out", help="The folder to write (new or empty; --force replaces an earlier export).")
    ],
    db: opt.Db = opt.DEFAULT_DB,
    job: Annotated[int | None, typer.Option(help="The job to export (default: the newest in --db).")] = None,
    step: Annotated[
        int | None, typer.Option(help="The checkpoint to export, by step (default: the job's newest).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an earlier export in --out.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print what was written as one JSON object.")] = False,
) -> None:
    """Write a job's trained model as a folder transformers loads (safetensors, config, tokenizer)."""
    for flag, value in (("--job", job), ("--step", step)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be 1 or more, got {value}")
    done = export_job(db, out, job=job, step=step, force=force)
    if as_json:
        opt.print_json({"out": str(done.out), **done.info()})
        return
    console = Console(highlight=False)
    loss = f"training loss {done.loss:.4f}" if done.loss is not None else "no loss recorded"
    console.print(
        f"wrote {done.out}: job {done.job}, step {done.step:,}/{done.steps:,}, {done.model} as "
        f"{done.architecture} ({done.parameters:,} parameters), {loss}, reads {done.tokens.value}",
        soft_wrap=True,
    )
    console.print(
        f"load it with transformers.AutoModelForCausalLM.from_pretrained({str(done.out)!r}), "
        f"or try it: cleave sample {done.out} --prompt TEXT",
        soft_wrap=True,
    )
