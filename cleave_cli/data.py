"""``cleave data prepare``: tokenize text or JSONL once into token shards ``--data`` streams."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from cleave.cli import options as opt
from cleave.cli.errors import friendly, is_terminal
from cleave.wire.errors import ConfigError


@friendly
def prepare(
    source: Annotated[Path, typer.Argument(help="A UTF-8 text file or folder, or JSONL (.jsonl), to tokenize.")],
    out: Annotated[
        Path, typer.Option("--out", help="The folder to write the shards into (created; must be new or empty).")
    ],
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="Tokenize as this model's job would: a preset's byte ids (the default), or hf:DIR's tokenizer.",
        ),
    ] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            "--tokenizer", help="A tokenizer.json (or a folder with one, or one transformers' AutoTokenizer reads)."
        ),
    ] = None,
    train_tokenizer: Annotated[
        bool,
        typer.Option(
            "--train-tokenizer",
            help="Train a byte-level BPE (the tokenizers library) on SOURCE first and save it beside the shards "
            "as tokenizer.json; needs --vocab-size.",
        ),
    ] = False,
    vocab_size: Annotated[
        int | None, typer.Option("--vocab-size", help="The trained tokenizer's vocabulary, 260 to 1,048,576.")
    ] = None,
    data_field: opt.DataField = "text",
    shard_tokens: Annotated[int, typer.Option("--shard-tokens", help="Token ids per shard file at most.")] = 1 << 27,
) -> None:
    """Tokenize text or JSONL into token shards (uint16 when the vocabulary fits, else uint32) with a
    shards.json; pass the folder as --data."""
    from cleave.coordinator.training import prepare as prep

    chosen = [
        name
        for name, given in (("--model", model), ("--tokenizer", tokenizer), ("--train-tokenizer", train_tokenizer))
        if given
    ]
    if len(chosen) > 1:
        raise ConfigError(f"pass one of --model, --tokenizer and --train-tokenizer, not {' and '.join(chosen)}")
    if train_tokenizer != (vocab_size is not None):
        raise ConfigError("--train-tokenizer and --vocab-size go together")
    if not 1 <= shard_tokens <= 1 << 40:
        raise ConfigError(f"--shard-tokens must be between 1 and 2^40, got {shard_tokens}")
    if not source.exists():
        raise ConfigError(f"{source}: no such file or folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty folder")
    out.mkdir(parents=True, exist_ok=True)
    console = Console(highlight=False)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not is_terminal(),
    ) as bar:
        if train_tokenizer:
            assert vocab_size is not None
            task = bar.add_task("training the tokenizer", total=None)
            encoder = prep.train_bpe(
                source, data_field, vocab_size, out, lambda done, total: bar.update(task, completed=done, total=total)
            )
        elif tokenizer is not None:
            encoder = prep.folder_encoder(tokenizer)
        else:
            encoder = prep.model_encoder(model or "tiny")
        task = bar.add_task("tokenizing", total=None)
        meta = prep.prepare(
            source,
            out,
            encoder,
            field=data_field,
            shard_tokens=shard_tokens,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    console.print(
        f"wrote {meta.tokens:,} tokens in {len(meta.shards)} shard{'s' if len(meta.shards) != 1 else ''} "
        f"({meta.dtype}, vocabulary {meta.vocab_size:,}, tokenizer {meta.tokenizer}) to {out}; "
        f"train on them with --data {out}",
        soft_wrap=True,
    )
