"""The training loop, shared by the local baseline and the coordinator.

Only the matmul engine differs: ``Trainer(cfg)`` is plain torch; ``Trainer(cfg, engine)`` sends
every Linear GEMM through ``engine`` (tiles on volunteers). Same seed, same init, same batches,
same optimizer: the same losses up to float rounding.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from cleave.coordinator.planning.costmodel import PARTS_IN_FLIGHT
from cleave.coordinator.training import data as corpora
from cleave.coordinator.training import models, prepare
from cleave.coordinator.training.data import ByteBatches, HeldOut, Split, load_corpus
from cleave.coordinator.training.linear import MatmulEngine, offload_linears
from cleave.coordinator.training.parallel import DataParallel, ShardedAdamW
from cleave.coordinator.training.shards import BIN_DTYPES
from cleave.coordinator.training.tokens import in_memory
from cleave.wire.errors import CleaveError, ConfigError

# How a step computes: fp32; bf16 (weights, activations and optimizer state in bfloat16); fp16
# (float32 weights, forward under float16 autocast, a dynamic loss scaler); autocast (float32
# weights, forward under bfloat16 autocast). The loss is always returned as a float.
PRECISIONS = ("fp32", "bf16", "fp16", "autocast")
_AUTOCAST = {"fp16": torch.float16, "autocast": torch.bfloat16}

MAX_STEPS = 10_000_000  # --steps and --warmup at most
VAL_FRACTION = 0.01  # --val-fraction: the last 1% of the corpus's tokens held out
EVAL_EVERY = 50  # --eval-every: the held-out loss every 50 steps (~2% more forward GEMMs with 4 batches)
EVAL_BATCHES = 4  # --eval-batches
MAX_EVAL_BATCHES = 1000
# What a job stored before the data options existed trained on all of its corpus and never
# evaluated: a job resumed from such a row keeps doing so (job.py, Trainer.load_state_dict).
BEFORE_DATA_OPTIONS: dict[str, Any] = {
    "data_field": "text",
    "data_dtype": None,
    "vocab_size": 0,
    "val_data": None,
    "val_fraction": 0.0,
    "eval_every": 0,
    "eval_batches": EVAL_BATCHES,
}
# The learning rate's floor, as a share of --lr, that the cosine decay reaches at the last step
# unless --min-lr names one.
MIN_LR_SHARE = 0.1

# Micro-batches through forward and backward at once (an engine that takes concurrent GEMMs):
# at most PARTS_IN_FLIGHT (8) started and not yet summed (a window: part i + 8 starts once part
# i is summed), so the activations held are at most that many parts' (with --micro-batches M:
# min(M, 8)/M of the whole batch's, never more than --micro-batches 1 holds), and the gradients
# held besides the sum at most that many copies, each the parameters' size in their dtype.


def draws_randomness(model: nn.Module) -> bool:
    """Whether a training forward may draw from torch's random state (dropout), which is one
    generator for every thread: parts run at once would draw in a different order each run.
    Functional dropout inside a module's own ``forward`` cannot be seen here: a model given as
    a factory (``custom:``) is never run in parts at once for that reason."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        config = getattr(module, "config", None)  # a transformers model's dropout lives in its config
        for name in dir(config) if config is not None else ():
            if ("dropout" in name or "pdrop" in name) and not name.startswith("_"):
                try:
                    value = getattr(config, name)
                except Exception:  # a config property that cannot answer: assume the worst
                    return True
                if isinstance(value, float | int) and not isinstance(value, bool) and value > 0:
                    return True
    return False


@dataclass(frozen=True)
class TrainConfig:
    model: str = "tiny"
    steps: int = 20
    batch_size: int = 8
    seq_len: int = 64
    lr: float = 3e-3
    seed: int = 1337
    data: str | None = None
    weight_decay: float = 0.1  # AdamW's, on matrices only (--weight-decay)
    grad_clip: float = 1.0  # the gradients' global L2 norm at most this; 0: no clipping (--grad-clip)
    warmup: int = 10  # steps of linear warm-up to --lr (--warmup)
    min_lr: float | None = None  # the cosine decay's floor at the last step; None: MIN_LR_SHARE of --lr (--min-lr)
    precision: str = "fp32"  # fp32 | bf16 (weights too) | fp16 (autocast, loss scaler) | autocast (bf16)
    micro_batches: int = 1  # the batch's sequences in this many equal parts, their gradients summed; 0: auto
    # The data (coordinator/training/data.py, docs/cli.md's Training data):
    data_field: str = "text"  # a JSONL record's text (--data-field)
    data_dtype: str | None = None  # a .bin shard's ids without a shards.json beside it (--data-dtype)
    vocab_size: int = 0  # a preset's vocabulary; 0: its own (256 bytes). Set from shards.json by the CLI
    val_data: str | None = None  # the held-out data (--val-data); None: the last val_fraction of --data
    val_fraction: float = VAL_FRACTION  # of --data's tokens held out (without --val-data, when evaluating); 0: none
    eval_every: int = EVAL_EVERY  # steps between evaluations of the held-out loss; 0: never
    eval_batches: int = EVAL_BATCHES  # fixed batches of --batch-size sequences each evaluation reads

    def __post_init__(self) -> None:
        try:
            max_seq = models.max_seq_len(self.model)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        checks = [
            (1 <= self.steps <= MAX_STEPS, "steps", f"must be between 1 and {MAX_STEPS:,}, got {self.steps}"),
            (1 <= self.batch_size <= 4096, "batch_size", f"must be between 1 and 4096, got {self.batch_size}"),
            (
                2 <= self.seq_len <= max_seq,
                "seq_len",
                f"must be between 2 and {max_seq} for model {self.model}, got {self.seq_len}",
            ),
            (math.isfinite(self.lr) and 0 < self.lr <= 1, "lr", f"must be in (0, 1], got {self.lr}"),
            (0 <= self.seed < 2**63, "seed", f"must be a non-negative 64-bit integer, got {self.seed}"),
            (0 <= self.warmup <= MAX_STEPS, "warmup", f"must be between 0 and {MAX_STEPS:,} steps, got {self.warmup}"),
            (
                self.min_lr is None or (math.isfinite(self.min_lr) and 0 <= self.min_lr <= self.lr),
                "min_lr",
                f"must be between 0 and the peak learning rate ({self.lr:g}), got {self.min_lr}",
            ),
            (
                math.isfinite(self.weight_decay) and 0 <= self.weight_decay <= 1,
                "weight_decay",
                f"must be between 0 and 1, got {self.weight_decay}",
            ),
            (
                math.isfinite(self.grad_clip) and self.grad_clip >= 0,
                "grad_clip",
                f"must be a finite number >= 0 (0: no clipping), got {self.grad_clip}",
            ),
            (
                self.micro_batches == 0  # auto: the cost model's choice from the fleet (a coordinator's job)
                or (1 <= self.micro_batches <= self.batch_size and self.batch_size % self.micro_batches == 0),
                "micro_batches",
                f"must divide the batch's {self.batch_size} sequences, got {self.micro_batches}",
            ),
            (
                math.isfinite(self.val_fraction) and 0 <= self.val_fraction <= 0.5,
                "val_fraction",
                f"must be between 0 and 0.5, got {self.val_fraction}",
            ),
            (
                0 <= self.eval_every <= MAX_STEPS,
                "eval_every",
                f"must be between 0 (never) and {MAX_STEPS:,} steps, got {self.eval_every}",
            ),
            (
                1 <= self.eval_batches <= MAX_EVAL_BATCHES,
                "eval_batches",
                f"must be between 1 and {MAX_EVAL_BATCHES}, got {self.eval_batches}",
            ),
            (
                self.data_dtype is None or self.data_dtype in BIN_DTYPES,
                "data_dtype",
                f"must be one of {', '.join(BIN_DTYPES)}, got {self.data_dtype!r}",
            ),
            (
                bool(self.data_field) and self.data_field.isprintable() and len(self.data_field) <= 256,
                "data_field",
                f"must name a JSON field (1 to 256 printable characters), got {self.data_field!r}",
            ),
            (
                self.vocab_size == 0 or (models.is_preset(self.model) and 2 <= self.vocab_size <= 1 << 32),
                "vocab_size",
                f"must be 0 (the model's own) or 2 to 2^32 for a preset; got {self.vocab_size} for {self.model}",
            ),
            (
                self.precision in PRECISIONS,
                "precision",
                f"must be one of {', '.join(PRECISIONS)}, got {self.precision!r}",
            ),
        ]
        for ok, name, detail in checks:
            if not ok:
                raise ConfigError(detail, field=name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float
    tokens: int
    seconds: float
    lr: float
    extra: dict[str, Any] = field(default_factory=dict)

    def metrics(self) -> dict[str, Any]:
        out = {"step": self.step, "loss": self.loss, "tokens": self.tokens, "seconds": self.seconds, "lr": self.lr}
        out.update(self.extra)
        return out


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        engine: MatmulEngine | None = None,
        corpus: bytes | Split | None = None,
        model_factory: Callable[[], nn.Module] | None = None,
        device: torch.device | None = None,
        parallel: DataParallel | None = None,
    ) -> None:
        """``model_factory``: builds the model of a ``custom:LABEL`` job (docs/api.md); it is
        called after the seed is set, so it gives the same weights wherever it runs.
        ``device``: where the model, its optimizer and every op that is not an offloaded GEMM
        run (``hardware.coordinator_device``); the model is built on the CPU first, so a seed
        gives the same initial weights on any device.
        ``parallel``: this trainer is one rank of a tier (``coordinator/training/parallel.py``):
        it trains its slice of each global batch, the gradients are summed over the ranks, and
        AdamW's state is sharded across them; every rank logs the global loss."""
        self.cfg = cfg
        self.device = device or torch.device("cpu")
        self.parallel = parallel
        if parallel is not None:
            if cfg.batch_size % parallel.world:
                raise ConfigError(
                    f"--batch-size {cfg.batch_size} does not cut into {parallel.world} equal slices, one per rank"
                )
            if cfg.precision == "fp16":
                raise ConfigError("--precision fp16 (its loss scaler) does not run on a tier yet: use bf16 or autocast")
        if (model_factory is not None) != models.is_custom(cfg.model):
            raise ConfigError("a model_factory goes with a model named custom:LABEL, and only with one")
        torch.manual_seed(cfg.seed)
        try:
            self.model = model_factory() if model_factory is not None else models.build(cfg.model, cfg.vocab_size)
        except ValueError as exc:  # an hf:DIR that transformers cannot build
            raise ConfigError(str(exc)) from None
        if cfg.precision == "bf16":
            self.model.to(torch.bfloat16)
        self.model.to(self.device)
        self.autocast = _AUTOCAST.get(cfg.precision)
        self.scaler = torch.amp.GradScaler(self.device.type) if cfg.precision == "fp16" else None
        if self.scaler is not None and hasattr(engine, "overflow_here"):
            engine.overflow_here = True  # an overflowing step is the scaler's to skip (RemoteEngine)
        self.offloaded = offload_linears(self.model, engine) if engine is not None else 0
        # Engines that label their GEMMs by step (the coordinator's) hear when each step starts.
        self.begin_step: Callable[[int], None] | None = getattr(engine, "begin_step", None)
        # Engines that compute weight gradients in the background hand them over after backward.
        self.finish_backward: Callable[[], None] | None = getattr(engine, "finish_backward", None)
        # Engines that take GEMMs from several threads at once (the coordinator's) get the
        # micro-batches concurrently: while one part waits on the devices, the others' GEMMs are out.
        self.take_deferred: Callable[[], list] | None = getattr(engine, "take_deferred", None)
        # Whether the parts may run at once: concurrent GEMMs, and no random draws whose order
        # would then depend on the threads.
        self.concurrent = (
            self.take_deferred is not None
            and getattr(engine, "takes_parts_at_once", False)
            and model_factory is None
            and not draws_randomness(self.model)
        )
        self._pool: ThreadPoolExecutor | None = None
        self.micro_batches = self.parts_at_once = 1
        # 0 (--micro-batches auto): one part until the job asks for the cost model's choice.
        self.use_micro_batches(cfg.micro_batches or 1)
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        self.optimizer: torch.optim.AdamW | ShardedAdamW
        if parallel is None:
            self.optimizer = torch.optim.AdamW(
                [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                lr=cfg.lr,
                betas=(0.9, 0.95),
                foreach=False,
            )
        else:  # ZeRO-1: this rank's slice of AdamW's state; the same update, elementwise
            self.optimizer = ShardedAdamW(
                [(decay, cfg.weight_decay), (no_decay, 0.0)],
                parallel,
                lr=cfg.lr,
                betas=(0.9, 0.95),
                order=list(self.model.parameters()),  # the clip's order, as clip_grad_norm_ below
            )
        data = corpus if isinstance(corpus, Split) else open_data(cfg, corpus)
        # Recorded at the start, kept in each checkpoint: the data a resume must find again, and
        # a preset's tokenizer for `cleave export` (wherever the data folder has gone since).
        self.data_fingerprint = corpora.fingerprint(data)
        self.tokenizer = prepare.tokenizer_record(cfg.data) if models.is_preset(cfg.model) else None
        self.batches = ByteBatches(data.train, cfg.seq_len, cfg.batch_size, np.random.default_rng(cfg.seed))
        # Fixed batches of the held-out part, none of the training RNG's draws (None: no evaluation).
        self.held_out = (
            HeldOut(data.held_out, cfg.seq_len, cfg.batch_size, cfg.eval_batches)
            if data.held_out is not None and cfg.eval_every
            else None
        )
        self.step = 0
        self.tokens_seen = 0

    @property
    def local_batch(self) -> int:
        """Sequences this trainer computes each step: the batch, or its rank's slice of it."""
        return self.cfg.batch_size // (self.parallel.world if self.parallel is not None else 1)

    def use_micro_batches(self, parts: int) -> None:
        """Cut each batch (a rank's slice, on a tier) into ``parts`` from the next step on (the
        same step, to float error); up to ``PARTS_IN_FLIGHT`` of them at once where the engine
        and the model allow it."""
        batch = self.local_batch
        if not 1 <= parts <= batch or batch % parts:
            what = "the batch size" if self.parallel is None else "each rank's slice of the batch"
            raise ConfigError(f"micro-batches must divide {what} ({batch}), got {parts}")
        at_once = min(parts, PARTS_IN_FLIGHT) if self.concurrent else 1
        if self._pool is not None and at_once != self.parts_at_once:
            self._pool.shutdown()
            self._pool = None
        self.micro_batches, self.parts_at_once = parts, at_once

    def state_dict(self) -> dict[str, Any]:
        """Everything that decides the next step, for a checkpoint."""
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            **({"cuda_rng": torch.cuda.get_rng_state(self.device)} if self.device.type == "cuda" else {}),
            "data_rng": self.batches.rng.bit_generator.state,
            "data_tokens": len(self.batches.part),  # the training part's length: a changed corpus is refused
            "data_fingerprint": self.data_fingerprint,  # its files, sizes and edges (corpora.fingerprint)
            **({prepare.TOKENIZER_KEY: self.tokenizer} if self.tokenizer is not None else {}),
            "config": self.cfg.to_dict(),
            **({"scaler": self.scaler.state_dict()} if self.scaler is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Checkpoints from before --precision, --micro-batches and --min-lr had none of them.
        saved = {
            "precision": "fp32",
            "micro_batches": 1,
            "min_lr": None,
            **BEFORE_DATA_OPTIONS,
            **(state.get("config") or {}),
        }
        if saved != self.cfg.to_dict():
            raise ConfigError("the checkpoint was written by a job with other options")
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and "cuda_rng" in state:  # dropout on a GPU draws from its own generator
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        if "data_tokens" in state and int(state["data_tokens"]) != len(self.batches.part):
            raise ConfigError(
                f"the corpus changed since the checkpoint: {int(state['data_tokens']):,} training tokens then, "
                f"{len(self.batches.part):,} now; the same --data is needed to resume"
            )
        if "data_fingerprint" in state and state["data_fingerprint"] != self.data_fingerprint:
            raise ConfigError(
                "the corpus changed since the checkpoint (its files, their sizes or contents, or the held-out "
                "part differ); the same --data is needed to resume"
            )
        self.batches.rng.bit_generator.state = state["data_rng"]
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])

    def lr_at(self, step: int) -> float:
        """Linear warm-up over ``warmup`` steps to ``lr``, then cosine decay to the floor
        (``min_lr``, else ``MIN_LR_SHARE`` of ``lr``) at the last step."""
        cfg = self.cfg
        if cfg.warmup and step <= cfg.warmup:
            return cfg.lr * step / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        # As a share of lr, so the default floor gives the same bits as before --min-lr existed.
        floor = MIN_LR_SHARE if cfg.min_lr is None else cfg.min_lr / cfg.lr
        return cfg.lr * (floor + (1 - floor) / 2 * (1 + math.cos(math.pi * min(1.0, progress))))

    def train_step(self) -> StepResult:
        started = time.perf_counter()
        self.step += 1
        if self.begin_step is not None:
            self.begin_step(self.step)
        lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x, y = self.batches.next()  # (B, T): the global batch, the same on every rank of a tier
        world = 1
        if self.parallel is not None:  # this rank's slice of it, fixed by step
            rows = self.parallel.slice_of(self.cfg.batch_size)
            x, y, world = x[rows], y[rows], self.parallel.world
        x, y = x.to(self.device), y.to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        parts = list(zip(x.chunk(self.micro_batches), y.chunk(self.micro_batches), strict=True))
        share = 1 / (len(parts) * world)  # equal parts: each loss weighted by its share of the global batch
        if self.parts_at_once > 1:
            loss_sum = self._parts_at_once(parts, share)
        else:
            # Micro-batches one after another. Each loss is its part's mean weighted by its share
            # of the tokens, so the gradients, summed in .grad in part order, are the whole
            # batch's to float error (losses within 2e-7 relative here). Only one part's
            # activations are held at a time.
            loss_sum = 0.0
            for xs, ys in parts:
                with self._autocast():
                    _, part = self.model(xs, ys)
                assert part is not None
                loss = part * share if share != 1 else part
                (loss if self.scaler is None else self.scaler.scale(loss)).backward()
                if self.finish_backward is not None:
                    self.finish_backward()
                loss_sum += float(loss.item())
        tokens = x.numel()
        try:
            result = self._finish_step(started, loss_sum, tokens, lr)
            # Every --eval-every steps and at the last: the final model's held-out loss is reported.
            if self.held_out is not None and (self.step % self.cfg.eval_every == 0 or self.step == self.cfg.steps):
                evaluating = time.perf_counter()
                val_loss = self.evaluate()
                extra = {**result.extra, "val_loss": val_loss, "eval_s": time.perf_counter() - evaluating}
                result = dataclasses.replace(result, extra=extra)
            return result
        except RuntimeError as exc:  # gloo's errors: a rank may have gone during the sums
            # (The tier's own word, a RankLost from its barrier, names the rank already.)
            if self.parallel is not None and self.parallel.on_failure is not None and not isinstance(exc, CleaveError):
                self.parallel.on_failure(exc)
            raise

    def _finish_step(self, started: float, loss_sum: float, tokens: int, lr: float) -> StepResult:
        """The step's gradients summed over the tier (if any), clipped and applied."""
        sharded = isinstance(self.optimizer, ShardedAdamW)
        extra: dict[str, Any] = {}
        if self.parallel is not None and sharded:
            # Each rank ends with the global batch's gradient of the parameters it steps (float32,
            # summed in rank order), and every rank with its loss and token count (float64), so
            # clipping and logging are the same everywhere.
            arrived = time.perf_counter()
            self.parallel.arrive(self.step)
            summing = time.perf_counter()
            self.optimizer.reduce_gradients()
            loss_sum, tokens_f = self.parallel.all_sum([loss_sum, float(tokens)])
            tokens = int(tokens_f)
            # The tier's share of the step: waiting at the barrier for the slowest rank, then the
            # gradients' reduce-scatter with the scalars (the clip's norms and the weights'
            # all-gather are added below).
            extra = {"tier_wait_s": summing - arrived, "tier_sum_s": time.perf_counter() - summing}
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clipping sees the true gradients
        if self.cfg.grad_clip and sharded:
            clipping = time.perf_counter()
            self.optimizer.clip_grad_norm_(self.cfg.grad_clip)  # the tier's total, as below
            extra["tier_sum_s"] = extra.get("tier_sum_s", 0.0) + time.perf_counter() - clipping
        elif self.cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip, foreach=False)
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)  # skipped when a gradient overflowed fp16
            self.scaler.update()
        if sharded and self.parallel is not None:
            extra["tier_gather_s"] = self.optimizer.gather_seconds
        self.tokens_seen += tokens
        return StepResult(self.step, loss_sum, tokens, time.perf_counter() - started, lr, extra)

    def evaluate(self) -> float:
        """The mean loss of the held-out batches: the forward only, without gradients, in eval
        mode (no dropout: torch's random state is not drawn from), through the engine as a step's
        forward (a coordinator's GEMMs go out as verified tiles), one micro-batch at a time. On a
        tier each rank reads its slice of every batch and the ranks sum their shares. Draws from
        no RNG, so the next step is the one it would have been."""
        assert self.held_out is not None
        held, world = self.held_out, 1
        rows = slice(None)
        if self.parallel is not None:
            rows, world = self.parallel.slice_of(self.cfg.batch_size), self.parallel.world
        share = 1 / (len(held) * self.micro_batches * world)  # equal parts of equal batches
        total = 0.0
        training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for k in range(len(held)):
                    x, y = held.batch(k)  # (B, T)
                    x, y = x[rows].to(self.device), y[rows].to(self.device)
                    for xs, ys in zip(x.chunk(self.micro_batches), y.chunk(self.micro_batches), strict=True):
                        with self._autocast():
                            _, loss = self.model(xs, ys)
                        assert loss is not None
                        total += float(loss.float().item()) * share
        finally:
            self.model.train(training)
        if self.parallel is not None:
            (total,) = self.parallel.all_sum([total])
        return total

    def _autocast(self) -> torch.autocast:
        """The forward's autocast on the trainer's device (off unless --precision asks for it)."""
        return torch.autocast(
            self.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None
        )

    def _parts_at_once(self, parts: list[tuple[torch.Tensor, torch.Tensor]], share: float) -> float:
        """Forward and backward of every part at once, on ``parts_at_once`` threads; the loss.

        Each part's gradients are its own (``autograd.grad``, plus the weight gradients its
        backward deferred to the engine), never accumulated into a shared ``.grad`` as they come:
        they are summed here in part order, so the step is the same whichever part finishes
        first (the whole batch's gradient to float error, as one part after another)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.parts_at_once, thread_name_prefix="cleave-part")
        # The loss scaler's factor, made on this thread: its lazy set-up is not thread-safe.
        scale = None if self.scaler is None else self.scaler.scale(torch.ones((), device=self.device))
        # A window of parts_at_once: part i + parts_at_once starts once part i is summed, so at
        # most that many parts are running or done and waiting, each holding its activations or
        # its gradients (one copy of the parameters' size), whatever --micro-batches is. A part's
        # future leaves the window once summed: a future holds its result (the gradients).
        window: deque[Future] = deque()
        totals: list[torch.Tensor | None] = [None] * len(self._params)
        loss_sum = 0.0
        try:
            for xs, ys in parts[: self.parts_at_once]:
                window.append(self._pool.submit(self._one_part, xs, ys, share, scale))
            for index in range(len(parts)):  # in part order, each part's gradients dropped once added
                loss, grads = window.popleft().result()
                loss_sum += loss
                for i, grad in enumerate(grads):
                    if grad is not None:
                        totals[i] = grad if totals[i] is None else totals[i] + grad
                grads = grad = None  # summed: its copy goes before the next part starts
                if index + self.parts_at_once < len(parts):
                    xs, ys = parts[index + self.parts_at_once]
                    window.append(self._pool.submit(self._one_part, xs, ys, share, scale))
        finally:
            wait(window)  # every part started, even after one failed: no part's thread outlives its step
        for param, total in zip(self._params, totals, strict=True):
            if total is not None:
                param.grad = total
        return loss_sum

    def _one_part(
        self, xs: torch.Tensor, ys: torch.Tensor, share: float, scale: torch.Tensor | None
    ) -> tuple[float, list[torch.Tensor | None]]:
        """One part's loss and its gradient for each of ``self._params`` (None: none reached it)."""
        assert self.take_deferred is not None
        try:
            with self._autocast():
                _, part = self.model(xs, ys)
            assert part is not None
            loss = part * share
            grads = list(torch.autograd.grad(loss if scale is None else loss * scale, self._params, allow_unused=True))
        except BaseException:
            try:  # this thread's deferred dWs belong to the failed step: not to its next one
                self.take_deferred()
            except Exception:
                pass
            raise
        where = {id(p): i for i, p in enumerate(self._params)}
        for param, grad in self.take_deferred():  # in the order backward deferred them, as finish_backward adds
            i = where[id(param)]
            grads[i] = grad if grads[i] is None else grads[i] + grad
        return float(loss.item()), grads

    def close(self) -> None:
        """Stop the parts' threads (a trainer that ran parts at once holds a pool) and close the
        corpus's files."""
        self.batches.part.stream.close()
        if self.held_out is not None:
            self.held_out.part.stream.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def run(self, on_step: Callable[[StepResult], None] | None = None) -> list[StepResult]:
        results = []
        while self.step < self.cfg.steps:
            result = self.train_step()
            results.append(result)
            if on_step is not None:
                on_step(result)
        return results


def with_data_vocab(cfg: TrainConfig) -> TrainConfig:
    """A preset job on token shards takes their vocabulary (``shards.json``'s ``vocab_size``),
    stored with the job as ``vocab_size`` so a resume and an export build the same model; any
    other job is returned as it is. A ``--vocab-size`` given is for raw shards without a
    ``shards.json``; one that differs from the ``shards.json``'s is refused."""
    if not models.is_preset(cfg.model) or cfg.data is None:
        return cfg
    stated = corpora.stated_vocab(cfg.data)
    if cfg.vocab_size:
        if stated is not None and stated != cfg.vocab_size:
            raise ConfigError(
                f"--vocab-size {cfg.vocab_size} differs from the vocabulary of {stated} that {cfg.data}'s "
                f"{corpora.shards.META} states: leave --vocab-size out (it is for raw shards without one)"
            )
        return cfg
    if stated is None or stated == models.vocab_size(cfg.model):
        return cfg
    return dataclasses.replace(cfg, vocab_size=stated)


def open_data(cfg: TrainConfig, corpus: bytes | None = None) -> Split:
    """The job's data as the model's token ids, split into its training and held-out parts:
    ``corpus`` (text bytes, in memory: the Python API's and tests'), else ``--data`` (streamed,
    ``data.py``), else the default corpus; ``--val-data`` or the last ``--val-fraction`` held out."""
    try:
        vocab = models.vocab_size(cfg.model, cfg.vocab_size)
        tokenize = models.tokenizer(cfg.model)
        if corpus is not None or cfg.data is None:
            text = corpus if corpus is not None else load_corpus()
            ids = models.tokens(cfg.model, text).numpy()
            stream = in_memory(ids, vocab, "the corpus")
        else:
            stream = corpora.open_tokens(
                cfg.data, vocab_size=vocab, tokenize=tokenize, field=cfg.data_field, dtype=cfg.data_dtype
            )
        val = None
        if cfg.val_data is not None:
            val = corpora.open_tokens(
                cfg.val_data,
                vocab_size=vocab,
                tokenize=tokenize,
                field=cfg.data_field,
                dtype=cfg.data_dtype,
                flag="--val-data",
            )
    except ValueError as exc:  # an hf:DIR whose tokenizer does not load
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc)) from None
    # Nothing is held out of a job that never evaluates (--eval-every 0): it trains on all of it.
    return corpora.split(stream, val, cfg.val_fraction if cfg.eval_every else 0.0, cfg.seq_len)
