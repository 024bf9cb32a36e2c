"""The training loop, shared by the local baseline and the coordinator.

Only the matmul engine differs: ``Trainer(cfg)`` is plain torch; ``Trainer(cfg, engine)`` sends
every Linear GEMM through ``engine`` (tiles on volunteers). Same seed, same init, same batches,
same optimizer: the same losses up to float rounding.
"""

from __future__ import annotations

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

from coordinator.planning.costmodel import PARTS_IN_FLIGHT
from coordinator.training import models
from coordinator.training.data import ByteBatches, load_corpus
from coordinator.training.linear import MatmulEngine, offload_linears
from coordinator.training.parallel import DataParallel, ShardedAdamW
from coordinator.wire.errors import CleaveError, ConfigError

# How a step computes: fp32; bf16 (weights, activations and optimizer state in bfloat16); fp16
# (float32 weights, forward under float16 autocast, a dynamic loss scaler); autocast (float32
# weights, forward under bfloat16 autocast). The loss is always returned as a float.
PRECISIONS = ("fp32", "bf16", "fp16", "autocast")
_AUTOCAST = {"fp16": torch.float16, "autocast": torch.bfloat16}

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
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    warmup: int = 10
    precision: str = "fp32"  # fp32 | bf16 (weights too) | fp16 (autocast, loss scaler) | autocast (bf16)
    micro_batches: int = 1  # the batch's sequences in this many equal parts, their gradients summed; 0: auto

    def __post_init__(self) -> None:
        try:
            max_seq = models.max_seq_len(self.model)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        checks = [
            (1 <= self.steps <= 10_000_000, f"--steps must be between 1 and 10,000,000, got {self.steps}"),
            (1 <= self.batch_size <= 4096, f"--batch-size must be between 1 and 4096, got {self.batch_size}"),
            (
                2 <= self.seq_len <= max_seq,
                f"--seq-len must be between 2 and {max_seq} for model {self.model}, got {self.seq_len}",
            ),
            (math.isfinite(self.lr) and 0 < self.lr <= 1, f"--lr must be in (0, 1], got {self.lr}"),
            (0 <= self.seed < 2**63, f"--seed must be a non-negative 64-bit integer, got {self.seed}"),
            (self.weight_decay >= 0 and self.grad_clip >= 0 and self.warmup >= 0, "negative optimizer setting"),
            (
                self.micro_batches == 0  # auto: the cost model's choice from the fleet (a coordinator's job)
                or (1 <= self.micro_batches <= self.batch_size and self.batch_size % self.micro_batches == 0),
                f"--micro-batches must divide --batch-size ({self.batch_size}), got {self.micro_batches}",
            ),
            (
                self.precision in PRECISIONS,
                f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

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
        corpus: bytes | None = None,
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
            self.model = model_factory() if model_factory is not None else models.build(cfg.model)
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
        data = corpus if corpus is not None else load_corpus(cfg.data)
        try:
            ids = models.tokens(cfg.model, data)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.batches = ByteBatches(ids, cfg.seq_len, cfg.batch_size, np.random.default_rng(cfg.seed))
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
            "config": self.cfg.to_dict(),
            **({"scaler": self.scaler.state_dict()} if self.scaler is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Checkpoints from before --precision and --micro-batches had neither.
        saved = {"precision": "fp32", "micro_batches": 1, **(state.get("config") or {})}
        if saved != self.cfg.to_dict():
            raise ConfigError("the checkpoint was written by a job with other options")
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and "cuda_rng" in state:  # dropout on a GPU draws from its own generator
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        self.batches.rng.bit_generator.state = state["data_rng"]
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to 10% over the run."""
        cfg = self.cfg
        if cfg.warmup and step <= cfg.warmup:
            return cfg.lr * step / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))

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
            return self._finish_step(started, loss_sum, tokens, lr)
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
        """Stop the parts' threads (a trainer that ran parts at once holds a pool)."""
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
