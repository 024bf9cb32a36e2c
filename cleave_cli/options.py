"""Options shared by the commands that train (names are a contract: scripts and tests use them)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from coordinator.wire.errors import ConfigError
from coordinator.wire.messages import WireDtype

if TYPE_CHECKING:  # the training modules import torch: the commands that train import them
    from coordinator.training.loop import TrainConfig


Model = Annotated[
    str,
    typer.Option(
        "--model",
        help="Model preset: tiny (seconds on a CPU), small (~11M params), base "
        "(~45M); or hf:DIR, a transformers causal LM from folder DIR (config.json, "
        "optional model.safetensors and tokenizer; needs pip install 'cleave\\[hf]').",
    ),
]
Steps = Annotated[int, typer.Option("--steps", help="Optimizer steps to train.")]
BatchSize = Annotated[int, typer.Option("--batch-size", help="Sequences per step.")]
SeqLen = Annotated[int, typer.Option("--seq-len", help="Tokens (bytes) per sequence.")]
Lr = Annotated[float, typer.Option("--lr", help="Peak AdamW learning rate (warm-up, then cosine decay).")]
Seed = Annotated[int, typer.Option("--seed", help="Seed of weights and batches: the same seed gives the same losses.")]
Precision = Annotated[
    str,
    typer.Option(
        "--precision",
        help="How a step computes: fp32 (exact, the default); bf16 (weights and activations in "
        "bfloat16); fp16 (float32 weights, float16 autocast, a loss scaler); autocast (float32 weights, bfloat16 "
        "autocast). docs/cli.md has each mode's measured distance from float32.",
    ),
]
Data = Annotated[
    Path | None,
    typer.Option(
        "--data", help="UTF-8 text file or folder to train on. Default: this Python's standard library sources."
    ),
]
Metrics = Annotated[
    Path | None, typer.Option("--metrics", help="Write one JSON object per step (step, loss, tokens, seconds, ...).")
]

WireDtypeOpt = Annotated[
    WireDtype,
    typer.Option(
        "--wire-dtype",
        case_sensitive=False,
        help="What GEMM operands and results travel as: fp32 (exact, the default), or bf16 / fp16, which halve the "
        "bytes but round the operands, so losses drift from plain torch's (docs/cli.md has the measured drift). "
        "Devices still multiply and sum in float32 unless half precision is faster on them.",
    ),
]


Device = Annotated[
    str,
    typer.Option(
        "--device",
        help="Where the coordinator's own work runs (the model, attention, the optimizer, GEMMs kept home): auto "
        "(CUDA when torch sees a GPU, else the CPU), cpu or cuda. Tiles still travel through host memory.",
    ),
]


MicroBatches = Annotated[
    str,
    typer.Option(
        "--micro-batches",
        help="Cut each batch into this many equal parts, their gradients summed: the same step. The coordinator "
        "runs up to 8 parts at once (more GEMMs out on the devices; at most 8 parts' activations held), "
        "--local one after another (one part's activations). Must divide --batch-size. auto: the cost model "
        "forecasts the step on the devices that joined for each choice up to 8 and takes the best (1 with --local).",
    ),
]


def micro_batches_of(value: str) -> int:
    """``--micro-batches``: a number of parts, or ``auto`` (0: the cost model's choice)."""
    if value.strip().lower() == "auto":
        return 0
    try:
        parts = int(value)
    except ValueError:
        raise ConfigError(f"--micro-batches must be a whole number or auto, got {value!r}") from None
    if parts < 1:
        raise ConfigError(f"--micro-batches must be at least 1 (or auto), got {parts}")
    return parts


def train_config(
    model: str,
    steps: int,
    batch_size: int,
    seq_len: int,
    lr: float,
    seed: int,
    data: Path | None,
    precision: str = "fp32",
    micro_batches: str | int = 1,
) -> TrainConfig:
    from coordinator.training.loop import TrainConfig

    return TrainConfig(
        model=model,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        lr=lr,
        seed=seed,
        data=str(data) if data is not None else None,
        precision=precision,
        micro_batches=micro_batches if isinstance(micro_batches, int) else micro_batches_of(micro_batches),
    )


CaFile = Annotated[
    Path | None,
    typer.Option(
        "--cafile", help="Verify the coordinator's wss:// certificate against this CA (PEM) instead of the system's."
    ),
]
Insecure = Annotated[
    bool,
    typer.Option(
        "--insecure",
        help="Allow unencrypted ws:// to a host other than this machine (tokens and blocks travel in clear).",
    ),
]

GridOpt = Annotated[
    float | None,
    typer.Option(
        "--grid-gco2-kwh",
        min=0,
        max=2000,
        help="The carbon intensity of the grid this machine draws from, in grams of CO2 per kWh, to turn energy "
        "into CO2. Default: the coordinator's (the world's average, 436 g/kWh in 2022 by Ember's Global Electricity "
        "Review 2023, unless its operator states another); docs/operations.md, Energy and carbon.",
    ),
]
