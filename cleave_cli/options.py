"""Options shared by several commands (names are a contract: scripts and tests use them), how
commands read their secrets (read_secret) and print their ``--json`` documents (print_json)."""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console

from cleave.cli.errors import stderr_console
from cleave.wire.errors import ConfigError
from cleave.wire.messages import WireDtype

if TYPE_CHECKING:  # the training modules import torch: the commands that train import them
    from cleave.coordinator.training.loop import TrainConfig

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_DB = Path("cleave.db")  # the coordinator's database unless --db names another (CoordinatorConfig.db's)
Db = Annotated[Path, typer.Option("--db", help="The coordinator's SQLite file.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print one JSON object with stable keys.")]


HEARTBEAT_TIMEOUT = (0.5, 3600.0)  # seconds: the commands' bounds on --heartbeat-timeout (coordinator, simulate)


def check_heartbeat_timeout(seconds: float) -> None:
    """The commands' own bounds on ``--heartbeat-timeout`` (FaultPolicy takes any above 0: a bench's
    endless leases); the heartbeat itself derives from it (``FaultPolicy.beat``)."""
    low, high = HEARTBEAT_TIMEOUT
    if not (math.isfinite(seconds) and low <= seconds <= high):
        raise ConfigError(f"--heartbeat-timeout must be between {low:g} and {high:g} s, got {seconds:g}")


def print_json(document: Any, *, allow_nan: bool = True) -> None:
    """``--json``: ``document`` as one line on stdout, its keys sorted so that scripts can rely on
    them; ``allow_nan=False`` makes a NaN or an infinity an error instead of invalid JSON."""
    Console(highlight=False).out(json.dumps(document, sort_keys=True, allow_nan=allow_nan))


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
Warmup = Annotated[
    int, typer.Option("--warmup", help="Steps of linear learning-rate warm-up from 0 to --lr (0: none), 0-10,000,000.")
]
MinLr = Annotated[
    float | None,
    typer.Option(
        "--min-lr",
        help="The learning rate the cosine decay ends at, on the last step, 0 to --lr. Default: 10% of --lr.",
    ),
]
WeightDecay = Annotated[
    float,
    typer.Option("--weight-decay", help="AdamW's decoupled weight decay, on matrices only (not biases or norms), 0-1."),
]
GradClip = Annotated[
    float,
    typer.Option(
        "--grad-clip", help="Clip the gradients' global L2 norm to at most this before each step; 0: no clip."
    ),
]
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
        "--data",
        help="What to train on, streamed from disk whatever its size: a UTF-8 text file or folder, JSONL "
        "(.jsonl, the text in --data-field), or token shards (a folder `cleave data prepare` wrote, or .bin/.npy "
        "files). Default: this Python's standard library sources (8 MiB).",
    ),
]
DataField = Annotated[str, typer.Option("--data-field", help="The text field of each JSONL record.")]
DataDtype = Annotated[
    str | None,
    typer.Option(
        "--data-dtype",
        help="The ids' dtype of .bin shards without a shards.json beside them: uint16 or uint32 (raw "
        "little-endian ids, nanoGPT's layout).",
    ),
]
VocabSize = Annotated[
    int,
    typer.Option(
        "--vocab-size",
        help="A preset's vocabulary for raw .bin/.npy shards without a shards.json (their tokenizer's size; "
        "ids are checked against it at start). 0: the shards.json's, else 256 bytes.",
    ),
]
ValData = Annotated[
    Path | None,
    typer.Option(
        "--val-data", help="Held-out data (the forms of --data) for the held-out loss; then --data is not split."
    ),
]
ValFraction = Annotated[
    float,
    typer.Option(
        "--val-fraction",
        help="Without --val-data: the last this share of --data's tokens is held out (at least one window; "
        "training windows never reach it); 0: none.",
    ),
]
EvalEvery = Annotated[
    int,
    typer.Option(
        "--eval-every",
        help="Compute the held-out loss (val_loss) every this many steps and at the last; 0: never (nothing held out).",
    ),
]
EvalBatches = Annotated[
    int,
    typer.Option(
        "--eval-batches",
        help="Fixed held-out batches (of --batch-size sequences) each evaluation reads: the same ones every time.",
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


# --------------------------------------------------------------------------- training options
#
# Declared once: ``cleave coordinator start`` and ``cleave train`` take the same training options
# (train_options), each the TrainConfig field of its name, and build the TrainConfig the same way.

TRAIN_OPTIONS: dict[str, Any] = {
    "model": Model,
    "steps": Steps,
    "batch_size": BatchSize,
    "seq_len": SeqLen,
    "lr": Lr,
    "warmup": Warmup,
    "min_lr": MinLr,
    "weight_decay": WeightDecay,
    "grad_clip": GradClip,
    "seed": Seed,
    "data": Data,
    "data_field": DataField,
    "data_dtype": DataDtype,
    "vocab_size": VocabSize,
    "val_data": ValData,
    "val_fraction": ValFraction,
    "eval_every": EvalEvery,
    "eval_batches": EvalBatches,
    "precision": Precision,
    "micro_batches": MicroBatches,
}


def train_options(command: F) -> F:
    """``command`` with the training options (TRAIN_OPTIONS, TrainConfig's defaults) in the place
    of its ``train`` parameter, which gets the TrainConfig they describe."""
    from cleave.coordinator.training.loop import TrainConfig

    defaults = {name: getattr(TrainConfig(), name) for name in TRAIN_OPTIONS} | {"micro_batches": "auto"}
    own = inspect.signature(command, eval_str=True)  # typer reads the annotations as objects
    options = [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=defaults[name], annotation=kind)
        for name, kind in TRAIN_OPTIONS.items()
    ]
    params = [q for p in own.parameters.values() for q in (options if p.name == "train" else [p])]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        values = {name: kwargs.pop(name) for name in TRAIN_OPTIONS}
        return command(train=train_config(values), **kwargs)

    wrapper.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params} | {"return": own.return_annotation}
    return wrapper  # type: ignore[return-value]


def train_config(values: Mapping[str, Any]) -> TrainConfig:
    """The job the training options' ``values`` describe, the vocabulary read from --data's shards."""
    from cleave.coordinator.training.loop import TrainConfig, with_data_vocab

    paths = {name: str(values[name]) for name in ("data", "val_data") if values[name] is not None}
    with as_flags():
        cfg = TrainConfig(**{**values, **paths, "micro_batches": micro_batches_of(values["micro_batches"])})
        return with_data_vocab(cfg)


# --------------------------------------------------------------------------- fields and flags
#
# The configuration objects check their own fields and name them as the Python API spells them
# (ConfigError.field); a command names the flag that set the field instead.

FLAGS: dict[str, str] = {
    **{
        name: "--" + name.replace("_", "-")
        for name in (
            *TRAIN_OPTIONS,
            *("host", "port", "public_url", "db", "token", "operator_token", "certfile", "keyfile", "metrics"),
            *("min_devices", "checkpoint_every", "prune_steps", "linger", "planner", "ps_link_gbps", "ps_gflops"),
            *("send_threads", "wire_dtype", "grid_gco2_kwh", "device"),
        )
    },
    "TilingPolicy.max_edge": "--tile-size",
    "FaultPolicy.heartbeat_timeout": "--heartbeat-timeout",
    "FaultPolicy.lease_floor": "--lease-floor",
    "StandbyPolicy.after": "--standby-after",
    "StandbyPolicy.keepalive": "--standby-keepalive",
    "Limits.max_connections": "--max-connections",
    "TierOptions.timeout": "--tier-timeout",
}


@contextmanager
def as_flags() -> Iterator[None]:
    """A ConfigError raised inside about a field a flag sets names that flag (FLAGS)."""
    try:
        yield
    except ConfigError as exc:
        flag = FLAGS.get(exc.field or "")
        if flag is None:
            raise
        raise exc.called(flag) from None


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


# --------------------------------------------------------------------------- secrets
#
# Any local user can read a process's arguments (ps, /proc/PID/cmdline), but only its owner can
# read its environment: every token and secret can therefore come from the environment or from a
# file, and the command-line flag is only kept for scripts on single-user machines.


class Secret(Enum):
    """A secret a command takes, as the name of the environment variable that holds it."""

    JOIN_TOKEN = "CLEAVE_TOKEN"
    OPERATOR_TOKEN = "CLEAVE_OPERATOR_TOKEN"
    TIER_SECRET = "CLEAVE_TIER_SECRET"


MAX_SECRET_FILE = 4096  # bytes read from a secret file at most: it holds one short line


def secret_option(flag: str, what: str, secret: Secret) -> Any:
    """``flag``, which passes a secret: ``what`` it is, and the ways that keep it off a command line."""
    return typer.Option(flag, help=f"{what} Prefer {secret.value} or {flag}-file: other users can read a command line.")


def _file_option(flag: str, what: str) -> Any:
    return typer.Option(
        f"{flag}-file",
        help=f"Read {what} from this file (one line; a trailing newline is dropped), so that it never "
        "appears on a command line. A warning if other users may read it.",
    )


TokenFile = Annotated[Path | None, _file_option("--token", "the join token")]
OperatorTokenFile = Annotated[Path | None, _file_option("--operator-token", "the operator token")]
StatusTokenFile = Annotated[Path | None, _file_option("--token", "the operator token")]
TierSecretFile = Annotated[Path | None, _file_option("--tier-secret", "the tier's secret")]


def read_secret(
    value: str | None,
    path: Path | None,
    flag: str,
    secret: Secret | None,
    *,
    environ: Mapping[str, str] | None = None,
    warn: Callable[[str], None] | None = None,
) -> str | None:
    """A secret from ``flag`` (``value``), else from the file ``flag``-file names (``path``), else
    from ``secret``'s environment variable (None: none read, an empty one counts as unset); None
    when none holds it. Both a value and a file: a ConfigError, as is a file that cannot be read,
    is empty or holds more than one line. ``warn`` hears of a file other users may read or change."""
    file_flag = f"{flag}-file"
    if value is not None and path is not None:
        raise ConfigError(f"pass {flag} or {file_flag}, not both")
    if value is not None:
        return value
    if path is not None:
        return _secret_file(path, file_flag, warn or _warn)
    if secret is None:
        return None
    return (os.environ if environ is None else environ).get(secret.value) or None


def _secret_file(path: Path, file_flag: str, warn: Callable[[str], None]) -> str:
    try:
        with open(path, "rb") as f:  # not Path.read_bytes: read at most a bound (--token-file /dev/zero)
            mode = os.fstat(f.fileno()).st_mode
            raw = f.read(MAX_SECRET_FILE + 1)
    except OSError as exc:
        raise ConfigError(f"{file_flag}: cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_SECRET_FILE:
        raise ConfigError(f"{file_flag}: {path} is over {MAX_SECRET_FILE} bytes: it must hold one line, the secret")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{file_flag}: {path} is not UTF-8 text") from None
    line = text.removesuffix("\n").removesuffix("\r")
    if "\n" in line or "\r" in line:
        raise ConfigError(f"{file_flag}: {path} holds several lines; it must hold one, the secret")
    if not line.strip():
        raise ConfigError(f"{file_flag}: {path} is empty")
    if not line.isprintable():
        raise ConfigError(f"{file_flag}: {path} holds unprintable characters")
    # Like ssh with a private key, but a warning: a pipe (--token-file <(pass show x)) has no such bits.
    if os.name == "posix" and stat.S_ISREG(mode) and mode & 0o077:
        warn(f"warning: other users may read or change {path} (mode {stat.S_IMODE(mode):04o}); chmod 600 it")
    return line


def _warn(message: str) -> None:
    stderr_console().print(message, style="yellow", markup=False)
