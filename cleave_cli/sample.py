"""``cleave sample``: text from an exported model, streamed as it is generated."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cleave.cli.errors import friendly
from cleave.coordinator.training import generate

D = generate.Sampling()  # the defaults the options show


@friendly
def sample(
    folder: Annotated[Path, typer.Argument(help="A folder cleave export wrote (or any transformers causal LM).")],
    prompt: Annotated[str, typer.Option(help="The text to continue.")],
    max_new_tokens: Annotated[int, typer.Option(help="How many tokens to generate.")] = D.max_new_tokens,
    temperature: Annotated[
        float, typer.Option(help="Divides the logits before sampling; 0 picks the most likely token (greedy).")
    ] = D.temperature,
    top_k: Annotated[int, typer.Option(help="Sample from the k most likely tokens only; 0: from all.")] = D.top_k,
    seed: Annotated[int, typer.Option(help="Seeds the sampling: the same seed, the same text.")] = D.seed,
    greedy: Annotated[
        bool, typer.Option("--greedy", help="Always the most likely token (as --temperature 0).")
    ] = False,
) -> None:
    """Generate text from an exported model, greedy or sampled (seeded), streamed as it comes."""
    sampling = generate.Sampling(max_new_tokens, 0.0 if greedy else temperature, top_k, seed)
    loaded = generate.load(folder)
    ids = generate.encode(loaded, prompt)
    typer.echo(prompt, nl=False)
    new = generate.tokens(loaded.model, ids, sampling, loaded.max_len, loaded.stop)
    for piece in generate.text(loaded.tokenizer, new):
        typer.echo(piece, nl=False)
    typer.echo()
