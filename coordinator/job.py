"""One training job on a coordinator: store + core + websocket server + trainer thread.

``run_job`` is what ``cleave coordinator start`` calls. It serves until every step is done and
every device has been told the job is finished, then returns the step results.

A database that holds an unfinished job (its coordinator was killed or stopped) resumes it from
its newest good checkpoint; the steps after that checkpoint are computed again and, the state
being exact, give the same losses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import math
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
from torch import nn

from cleave.coordinator.engine.balance import Balancer, Pool
from cleave.coordinator.engine.books import Books
from cleave.coordinator.engine.core import Core, Departure
from cleave.coordinator.engine.energy import GRID_GCO2_KWH
from cleave.coordinator.engine.identity import STRONG_TOKEN, new_token
from cleave.coordinator.engine.limits import Limits, TrustPolicy
from cleave.coordinator.engine.live_plan import Planner
from cleave.coordinator.engine.profiles import measure_ps
from cleave.coordinator.engine.scheduler import FaultPolicy
from cleave.coordinator.engine.standby import StandbyPolicy
from cleave.coordinator.net.remote import RemoteEngine
from cleave.coordinator.net.server import Server, listen
from cleave.coordinator.planning.costmodel import MAX_PS_GFLOPS
from cleave.coordinator.planning.tiles import TilingPolicy
from cleave.coordinator.tier.group import HEARTBEAT, TIER_TIMEOUT, RankSummary, Tier, TierRefused, job_digest, join_tier
from cleave.coordinator.training import checkpoint, models
from cleave.coordinator.training.checkpoint import Resume
from cleave.coordinator.training.flops import GemmShare, gemm_share
from cleave.coordinator.training.hardware import DEVICES, coordinator_device, describe
from cleave.coordinator.training.loop import BEFORE_DATA_OPTIONS, StepResult, TrainConfig, Trainer, open_data
from cleave.db.sqlite import GROUP_SECONDS, SQLiteStore
from cleave.db.store import CheckpointRow
from cleave.meters import EnergyMeter
from cleave.wire.addresses import is_loopback, url_host
from cleave.wire.errors import CheckpointError, ConfigError
from cleave.wire.messages import MAX_GRID, MAX_TOKEN, MAX_URL, WireDtype

log = logging.getLogger(__name__)


# One thread beside the loop writes work frames' bytes to the sockets: the loop's CPU a tile fell
# 40-70% on Llama-2-7B tiles (bench/bench_tax.py --send-threads 0 1); more pay on many cores.
DEFAULT_SEND_THREADS = 1
MAX_SEND_THREADS = 64
LINGER = 300.0  # seconds ``cleave coordinator start`` keeps a finished job visible by default
MAX_LINGER = 7 * 86_400


@dataclass(frozen=True)
class CoordinatorConfig:
    train: TrainConfig = field(default_factory=TrainConfig)
    host: str = "127.0.0.1"
    port: int = 8765
    db: str = "cleave.db"
    token: str | None = None  # the join token; None: keep the database's, or generate one
    operator_token: str | None = None  # for cleave status; None: keep the database's, or generate
    certfile: str | None = None  # serve wss:// with this certificate chain ...
    keyfile: str | None = None  # ... and its private key
    metrics: str | None = None
    min_devices: int = 1
    policy: TilingPolicy = field(default_factory=TilingPolicy)
    faults: FaultPolicy = field(default_factory=FaultPolicy)
    standby: StandbyPolicy = field(default_factory=StandbyPolicy)  # when unneeded devices sleep (--standby-after)
    trust: TrustPolicy = field(default_factory=TrustPolicy)
    limits: Limits = field(default_factory=Limits)
    checkpoint_every: int = 50  # steps; 0 turns checkpoints off
    # At each checkpoint, delete the GEMM, tile and lease rows of finished GEMMs older than the last
    # this many steps (their counts are kept); 0 keeps every row (--prune-steps).
    prune_steps: int = 0
    new_job: bool = False  # start a new job even if the database holds an unfinished one
    planner: Planner = Planner.COST  # how GEMMs are cut and shared out (--planner)
    ps_link_gbps: float = 10.0  # the coordinator's link, each way (--ps-link-gbps)
    ps_gflops: float | None = None  # the coordinator's own GEMM rate for the cost model; None: measured
    wire_dtype: WireDtype = WireDtype.FP32  # what float32 operands and results travel as (--wire-dtype)
    band_checks: bool = True  # results checked a row band at a time (False: each alone; docs/security.md)
    # Threads that write devices' sockets beside the event loop (net/framing.py; --send-threads);
    # 0: the loop writes them itself.
    send_threads: int = DEFAULT_SEND_THREADS
    device: str = "auto"  # where the trainer's tensors live (--device auto|cpu|cuda; hardware.py)
    tier: TierOptions | None = None  # one rank of a job across several coordinators (tier/group.py)
    model_factory: Callable[[], nn.Module] | None = None  # builds a custom:LABEL model (docs/api.md)
    # Seconds a finished job stays visible (the page, /api/status, cleave status, /metrics) before
    # the coordinator exits; 0 exits at once. ``cleave coordinator start`` defaults to LINGER.
    linger: float = 0.0
    # The address volunteers reach this coordinator at, when it is not the one it listens on (a
    # proxy, a NAT, a name on its certificate): printed in the join command, and what a tier's
    # other ranks send newcomers to.
    public_url: str | None = None
    grid_gco2_kwh: float = GRID_GCO2_KWH  # the grid this coordinator and its volunteers draw from (--grid-gco2-kwh)

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise ConfigError(f"--port must be between 0 and 65535, got {self.port}")
        url = self.public_url
        if url is not None and not (
            url.startswith(("ws://", "wss://")) and url_host(url) and len(url) <= MAX_URL and url.isprintable()
        ):
            raise ConfigError(f"--public-url must be ws://HOST[:PORT] or wss://... (at most {MAX_URL} characters)")
        if not (0 <= self.min_devices <= 100_000):
            raise ConfigError(f"--min-devices must be between 0 and 100000, got {self.min_devices}")
        for flag, value in (("--token", self.token), ("--operator-token", self.operator_token)):
            if value is not None and not (value.strip() and value.isprintable() and len(value) <= MAX_TOKEN):
                raise ConfigError(f"{flag} must be 1 to {MAX_TOKEN} printable characters")
        if self.token is not None and self.token == self.operator_token:
            raise ConfigError("--operator-token must differ from the join token (--token)")
        if (self.certfile is None) != (self.keyfile is None):
            raise ConfigError("--certfile and --keyfile go together")
        if not (0.001 <= self.ps_link_gbps <= 10_000):
            raise ConfigError(f"--ps-link-gbps must be between 0.001 and 10000, got {self.ps_link_gbps}")
        if self.ps_gflops is not None and not (0.001 <= self.ps_gflops <= MAX_PS_GFLOPS):
            raise ConfigError(f"--ps-gflops must be between 0.001 and {MAX_PS_GFLOPS:,.0f}, got {self.ps_gflops}")
        if not (0 <= self.linger <= MAX_LINGER):
            raise ConfigError(f"--linger must be between 0 and {MAX_LINGER:,} s, got {self.linger:g}")
        if not (0 <= self.checkpoint_every <= 10_000_000):
            raise ConfigError(f"--checkpoint-every must be between 0 and 10,000,000, got {self.checkpoint_every}")
        if not (0 <= self.prune_steps <= 10_000_000):
            raise ConfigError(f"--prune-steps must be between 0 and 10,000,000, got {self.prune_steps}")
        if self.prune_steps and not self.checkpoint_every:
            raise ConfigError("--prune-steps prunes at each checkpoint: it needs --checkpoint-every above 0")
        if (self.model_factory is not None) != models.is_custom(self.train.model):
            raise ConfigError("a model_factory goes with a model named custom:LABEL, and only with one")
        if not (math.isfinite(self.grid_gco2_kwh) and 0 <= self.grid_gco2_kwh <= MAX_GRID):
            raise ConfigError(f"--grid-gco2-kwh must be between 0 and {MAX_GRID:g}, got {self.grid_gco2_kwh:g}")
        if not (0 <= self.send_threads <= MAX_SEND_THREADS):
            raise ConfigError(f"--send-threads must be between 0 and {MAX_SEND_THREADS}, got {self.send_threads}")
        if self.device.lower() not in DEVICES:
            raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")


@dataclass(frozen=True)
class TierOptions:
    """``--world-size``, ``--rank``, ``--rendezvous``, the tier's secret, ``--tier-timeout`` and
    ``--redirect``."""

    rendezvous: str
    rank: int | None
    world: int | None
    secret: str = field(repr=False)
    timeout: float = TIER_TIMEOUT
    redirect: bool = True  # send newcomers to the rank whose pool is weakest (tickets are admitted either way)

    def __post_init__(self) -> None:
        if not 1.0 <= self.timeout <= 3600:
            raise ConfigError(f"--tier-timeout must be between 1 and 3600 s, got {self.timeout:g}")


@dataclass
class JobOutcome:
    results: list[StepResult]
    status: dict  # the final status snapshot: tiles, devices, traffic, verification cost
    url: str = ""
    resumed_from: int | None = None  # the checkpoint step a resumed job started from


@dataclass(frozen=True)
class Listening:
    """What the operator needs once the coordinator listens."""

    url: str  # where it listens
    join_url: str  # the address other machines should join
    join_token: str | None  # None: the database's token was kept (only its hash is stored)
    operator_token: str | None  # likewise, for cleave status
    generated: tuple[str, ...] = ()  # "join" and/or "operator": generated by this start
    tls: bool = False
    exposed: bool = False  # unencrypted ws:// on an address other machines can reach


class Reporter(Protocol):
    """What the job tells its operator; the CLI renders it."""

    def listening(self, info: Listening) -> None: ...
    def note(self, text: str) -> None: ...
    def waiting(self, have: int, want: int) -> None: ...
    def step(self, result: StepResult, status: dict) -> None: ...
    def finished(self, results: list[StepResult], status: dict) -> None: ...


def _public_url(scheme: str, host: str, port: int) -> str:
    """The address other machines should join: a wildcard bind is no address to connect to."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"{scheme}://{host}:{port}"


def server_tls(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    """A TLS context for wss://, or None for plain ws://. Bad files are a ConfigError."""
    if certfile is None or keyfile is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load --certfile {certfile} / --keyfile {keyfile}: {exc}") from None
    return ctx


class _Metrics:
    """The --metrics JSONL file. A resumed job keeps the lines up to its checkpoint."""

    def __init__(self, path: str | None, keep_until: int | None = None) -> None:
        self.file = None
        if path is None:
            return
        kept: list[str] = []
        if keep_until is not None and Path(path).exists():
            for line in Path(path).read_text(encoding="utf-8").splitlines():
                try:
                    if json.loads(line).get("step", 0) <= keep_until:
                        kept.append(line)
                except (json.JSONDecodeError, AttributeError):
                    continue
        self.file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        for line in kept:
            self.file.write(line + "\n")

    def rewind(self, step: int) -> None:
        """Keep only the lines up to ``step`` (the job resumes from an older checkpoint)."""
        if self.file is None:
            return
        path = self.file.name
        self.file.close()
        self.__init__(path, keep_until=step)  # type: ignore[misc]

    def write(self, row: dict) -> None:
        if self.file is not None:
            self.file.write(metrics_line(row) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def metrics_line(row: dict) -> str:
    """One strict-JSON metrics line: a non-finite loss is written as null."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    return json.dumps(clean, sort_keys=True)


@dataclass
class _Plan:
    """What this start of the coordinator does: a new job, or the rest of an unfinished one."""

    books: Books
    train: TrainConfig
    resume: Resume | None


def _plan(cfg: CoordinatorConfig, store: SQLiteStore, reporter: Reporter, now: float) -> _Plan:
    taken = Books.take_over(store, now, new_job=cfg.new_job)
    unfinished = taken.unfinished
    if unfinished is None:
        name = f"{cfg.train.model} x {cfg.train.steps} steps"
        books = Books.create(store, name, cfg.train.to_dict(), cfg.train.steps, now, cfg.prune_steps)
        return _Plan(books, cfg.train, None)
    stored = unfinished.config.get("model")
    if (models.is_custom(stored or "") or cfg.model_factory is not None) and stored != cfg.train.model:
        # A factory builds only the model it was given for: never another job's.
        raise ConfigError(
            f"job {unfinished.id} in {cfg.db} trains {stored!r}, not {cfg.train.model!r}; pass "
            "--new-job (new_job=True) to start a new one"
        )
    try:
        train = TrainConfig(**{**BEFORE_DATA_OPTIONS, **unfinished.config})
    except (TypeError, ConfigError) as exc:
        raise ConfigError(f"job {unfinished.id} in {cfg.db} cannot be resumed ({exc}); pass --new-job") from None
    resume = checkpoint.newest_good(Books(store, unfinished.id).checkpoints())
    for why in resume.skipped:
        reporter.note(f"{why}; trying an older one")
    where = f"its checkpoint of step {resume.step}" if resume.state is not None else "the start (no usable checkpoint)"
    reporter.note(
        f"resuming job {unfinished.id} ({train.model}, {train.steps} steps, options as first given) "
        f"from {where}; pass --new-job to start over instead"
    )
    if taken.abandoned:
        reporter.note(f"{taken.abandoned} tiles in flight when the last coordinator stopped will be recomputed")
    return _Plan(Books.resume(store, unfinished.id, resume.step, now, cfg.prune_steps), train, resume)


CHOICE_TIMEOUT = 60.0  # seconds the trainer waits for --micro-batches auto's second choice

# The dtype the trainer's GEMMs reach the engine in, by --precision (float32 unless the model is).
_GEMM_DTYPE = {"bf16": "bf16", "fp16": "fp16", "autocast": "bf16"}


async def _choose_micro_batches(
    trainer: Trainer,
    core: Core,
    train: TrainConfig,
    cfg: CoordinatorConfig,
    reporter: Reporter,
    basis: str = "the devices that joined",
) -> tuple[int, str] | None:
    """``--micro-batches auto``: the cost model forecasts the step on the devices there now for
    each part count (``choose_micro_batches``); the parts it takes and the line that says why,
    for the trainer to take from its next step (``_use_micro_batches``); None (one part) where
    parts cannot run at once or the model's shape is not known to the cost model.
    Asked before the first step (the devices' claims) and again after it (their measured rates
    and links); the step is the same step whatever the parts, to float error."""
    from cleave.coordinator.whatif.presets import MODELS
    from cleave.coordinator.whatif.simulator import choose_micro_batches

    shape = MODELS.get(train.model)
    if not trainer.concurrent or shape is None:
        if trainer.step == 0:  # said once
            why = "its parts could not run at once" if not trainer.concurrent else "the cost model has no shape for it"
            reporter.note(f"micro-batches: 1 (auto: {why})")
        return None
    dtype = cfg.wire_dtype.value if cfg.wire_dtype.torch is not None else _GEMM_DTYPE.get(train.precision, "fp32")
    planner = core.planner
    profiles = core.fleet_profiles(dtype)  # on the loop, where the Core lives; the forecasts in a thread
    choice = await asyncio.to_thread(
        functools.partial(
            choose_micro_batches,
            shape,
            trainer.local_batch,  # a rank's slice, on a tier
            train.seq_len,
            dtype,
            planner.ps,
            planner.planner,
            planner.policy,
            profiles,
            keeps_home=False,  # the live coordinator keeps GEMMs home one by one, never a whole step
        )
    )
    return choice.micro_batches, choice.summary(basis)


def _use_micro_batches(trainer: Trainer, parts: int, apply_lanes: Callable[[int], None]) -> None:
    """Hand the trainer its parts, on the thread that trains (between steps: no part runs, so
    its pool of parts may be shut down without waiting on the event loop), and the planner its
    lanes (``apply_lanes``: on the loop, where the Core lives)."""
    trainer.use_micro_batches(parts)
    apply_lanes(trainer.parts_at_once)


async def serve_job(
    cfg: CoordinatorConfig,
    reporter: Reporter,
    *,
    clock: Callable[[], float] = time.time,
    ready: Callable[[str], None] | None = None,
    on_start: Callable[[Server], None] | None = None,
) -> JobOutcome:
    """Serve one job: wiring only. The engine keeps the books (``Books``, ``Core``); the server
    moves bytes; the trainer thread trains. ``ready(url)`` fires once listening; ``on_start(server)``
    hands benchmarks and tests the live server (read it only from this event loop). ``clock``
    is the wall clock records are stamped in: the engine reads it once, at start, and stamps
    each record with that time plus the monotonic seconds since, on which deadlines run."""
    loop = asyncio.get_running_loop()
    tls = server_tls(cfg.certfile, cfg.keyfile)
    # Each event-loop turn's tile writes join one commit at the turn's end.
    store = SQLiteStore(cfg.db, group_seconds=GROUP_SECONDS, defer=loop.call_soon)
    metrics: _Metrics | None = None
    plan: _Plan | None = None
    joined: asyncio.Future[Tier] | None = None  # the tier, once met (a job of several ranks)
    summaries: list[asyncio.Future[None]] = []  # keeping this rank's summary fresh for the tier
    results: list[StepResult] = []
    try:
        plan = _plan(cfg, store, reporter, clock())
        books, train_cfg = plan.books, plan.train
        # Fail fast on bad --data; the trainer reads this split's windows (streamed: docs/cli.md).
        corpus = await asyncio.to_thread(open_data, train_cfg)
        # The cost model's view of this machine: its GEMM, verification and copy rates, measured.
        device = coordinator_device(cfg.device)
        reporter.note(f"coordinator device: {describe(device)}")
        ps = await asyncio.to_thread(measure_ps, cfg.ps_link_gbps, device=device)
        if cfg.ps_gflops is not None:  # the operator keeps the coordinator's CPU for its own work
            ps = dataclasses.replace(ps, gflops=dict.fromkeys(ps.gflops, cfg.ps_gflops))
        elif cfg.wire_dtype.torch is not None:  # half-precision wire: a GEMM kept here runs in float32
            ps = dataclasses.replace(ps, gflops={**ps.gflops, cfg.wire_dtype.value: ps.gflops["fp32"]})
        # Verification vectors must be unpredictable to clients: OS entropy, never the public seed.
        core = Core(
            store,
            books.job_id,
            books=books,
            rng=np.random.default_rng(),
            policy=cfg.policy,
            faults=cfg.faults,
            trust=cfg.trust,
            limits=cfg.limits,
            epoch=clock() - time.monotonic(),
            job_name=f"{models.public_name(train_cfg.model)}, {train_cfg.steps} steps",
            planner=cfg.planner,
            ps=ps,
            grid_gco2_kwh=cfg.grid_gco2_kwh,
            band_checks=cfg.band_checks,
            standby=cfg.standby,
        )
        meter = EnergyMeter(gpu="cuda" if device.type == "cuda" else "", gpu_index=device.index or 0)
        meter.keep_reading()  # this process's own energy, read at each step's end (and between: wraps)
        reporter.note(f"energy: {meter.describe()}; grid {cfg.grid_gco2_kwh:g} gCO2/kWh")
        tokens = _tokens(cfg, core, reporter)
        start_step = plan.resume.step if plan.resume else 0
        core.resume_from(start_step)
        server = Server(core, time.monotonic, cfg.limits, send_threads=cfg.send_threads)
        if cfg.tier is not None and cfg.tier.rank is not None:  # labelled from the first scrape on
            server.metrics.rank = cfg.tier.rank
        if plan.resume:  # the dashboard's curves start with the steps before the checkpoint
            for row in books.steps():
                server.dashboard.step(row.step, row.loss, row.extra.get("val_loss"))
                if "val_loss" in row.extra:  # the last held-out loss shows until the next evaluation
                    core.progress.evaluated(row.step, row.extra["val_loss"])
        if on_start is not None:
            on_start(server)
        metrics = _Metrics(cfg.metrics, keep_until=start_step if plan.resume else None)
        folder = checkpoint.checkpoint_dir(cfg.db)
        final: dict = {}
        url = ""

        def record(result: StepResult) -> None:  # on the loop, where the engine keeps its books
            t = server.traffic
            predicted = core.prediction.current()  # its GEMMs were all submitted: it is over
            home = core.prediction.current_home()
            extra = {
                **result.extra,  # the trainer's own (a tier's collectives)
                "devices": len(core.devices),
                "mb_down": round(t.bytes_down / 1e6, 3),
                "mb_up": round(t.bytes_up / 1e6, 3),
                # What left the coordinator (to devices and relays), and what relays served for it.
                "mb_ps_out": round(t.bytes_down / 1e6, 3),
                "mb_relay_out": round(core.relays.bytes_named / 1e6, 3),
                "mb_to_relays": round(core.relays.bytes_served / 1e6, 3),  # of mb_ps_out
                "predicted_s": None if predicted is None else round(predicted, 4),
                # The cost model's step had the coordinator kept every GEMM (the plan never loses to it).
                "home_s": None if home is None or not math.isfinite(home) else round(home, 4),
                # The step's most shipped GEMMs out at once, and of them waited on by the trainer.
                "gemms_in_flight_max": core.peak_in_flight,
                "waited_gemms_max": core.peak_waited,
            }
            # Energy: what devices reported during the step (booked within their band) and what
            # this process used over it, per verified GFLOP and in grams of CO2 (engine/energy.py).
            span = meter.span()
            core.energy.own(span.joules, span.source, span.gpu_joules)
            extra.update(core.energy.close_step(core.gflop_verified).as_row())
            result = StepResult(result.step, result.loss, result.tokens, result.seconds, result.lr, extra)
            results.append(result)
            assert metrics is not None
            metrics.write(result.metrics())
            core.record_step(result.step, result.loss, result.tokens, result.seconds, extra, time.monotonic())
            server.record_step(result.step, result.loss, result.seconds, result.extra.get("val_loss"))
            reporter.step(result, server.status())

        def saved(row: CheckpointRow) -> None:  # on the loop
            checkpoint.prune(core.checkpointed(row))

        def shared(share: GemmShare) -> None:  # on the loop
            core.shared(share.to_dict())
            reporter.note(share.summary())

        def build(tier: Tier | None) -> Trainer:  # in a thread, while the devices join
            trainer = Trainer(
                train_cfg,
                RemoteEngine(server, loop, cfg.wire_dtype),
                corpus=corpus,
                model_factory=cfg.model_factory,
                device=device,
                parallel=None if tier is None else tier.parallel,
            )
            if trainer.parts_at_once > 1:  # planned as the trainer issues them: that many GEMMs side by side
                loop.call_soon_threadsafe(core.plan_lanes, trainer.parts_at_once)
            loop.call_soon_threadsafe(
                reporter.note,
                f"model: {models.describe(train_cfg.model)}, "
                f"{sum(p.numel() for p in trainer.model.parameters()):,} parameters",
            )
            # Counted on the model itself, before the first step (nothing is sent, no draw is used).
            try:
                loop.call_soon_threadsafe(shared, gemm_share(trainer.model, train_cfg.seq_len))
            except Exception:  # a report only: training goes on without it
                log.exception("could not count the model's GEMM FLOPs; the share stays unknown")
            if plan.resume is not None and plan.resume.state is not None:
                trainer.load_state_dict(plan.resume.state)
            return trainer

        def train(trainer: Trainer) -> None:  # in the trainer thread
            meter.restart()  # the first step's span starts with training, not with the wait for devices
            try:
                _train(trainer)
            finally:
                trainer.close()  # the micro-batches' threads, when they ran at once

        def _train(trainer: Trainer) -> None:
            first = True
            while trainer.step < train_cfg.steps:
                result = trainer.train_step()
                loop.call_soon_threadsafe(record, result)
                if first and train_cfg.micro_batches == 0 and trainer.step < train_cfg.steps:
                    # --micro-batches auto, again: the first step measured the devices. A choice
                    # that fails or takes too long leaves the parts as they are: never the job.
                    basis = f"the devices as step {trainer.step} measured them"
                    again = _choose_micro_batches(trainer, core, train_cfg, cfg, reporter, basis)
                    choosing = asyncio.run_coroutine_threadsafe(again, loop)
                    try:
                        chosen = choosing.result(CHOICE_TIMEOUT)
                    except Exception as exc:  # a report and a speed-up only: training goes on
                        choosing.cancel()
                        log.warning("choosing micro-batches again failed (%r); keeping %d", exc, trainer.micro_batches)
                    else:  # applied here, on the trainer thread, between steps
                        if chosen is not None:
                            lanes = functools.partial(loop.call_soon_threadsafe, core.plan_lanes)
                            _use_micro_batches(trainer, chosen[0], lanes)
                            loop.call_soon_threadsafe(reporter.note, chosen[1])
                first = False
                every = cfg.checkpoint_every
                if (every and trainer.step % every == 0) or trainer.step == train_cfg.steps:
                    # Between steps, in the thread that owns the model: a consistent state.
                    row = checkpoint.save(folder, books.job_id, trainer.step, trainer.state_dict(), clock())
                    loop.call_soon_threadsafe(saved, row)

        async with listen(server, cfg.host, cfg.port, tls) as ws_server:
            ticker = asyncio.create_task(server.tick_forever())
            try:
                port = ws_server.sockets[0].getsockname()[1] if ws_server.sockets else cfg.port
                scheme = "wss" if tls else "ws"
                url = f"{scheme}://{cfg.host}:{port}"
                public = cfg.public_url or _public_url(scheme, cfg.host, port)
                reporter.listening(
                    Listening(
                        url,
                        public,
                        *tokens,
                        tls=tls is not None,
                        exposed=tls is None and not is_loopback(cfg.host),
                    )
                )
                if ready is not None:
                    ready(url)
                core.waiting()
                # The model is built (torch's optimizer alone takes a second or two to import) while
                # the devices join; a model that cannot be built fails the job without waiting for them.
                if cfg.tier is not None:  # meet and prove every rank while the devices join
                    joined = asyncio.ensure_future(_join(cfg.tier, train_cfg, plan, reporter))

                async def built() -> Trainer:  # a rank's trainer needs its place in the tier
                    tier = None if joined is None else await joined
                    resumed = plan.resume.step if plan.resume else 0
                    if resumed != start_step:  # the ranks agreed on an older checkpoint than this rank's
                        Books.resume(store, books.job_id, resumed, clock())
                        core.resume_from(resumed)
                        metrics.rewind(resumed)
                    if tier is not None:  # the whole tier in status, the dashboard and /metrics
                        summaries.append(
                            asyncio.ensure_future(_summarise(tier, core, server, public, cfg.tier.redirect))
                        )
                        server.tier_view = tier.view
                        server.metrics.rank = tier.rank
                    return await asyncio.to_thread(build, tier)

                building = asyncio.ensure_future(built())
                if start_step < train_cfg.steps:  # a job killed after its last step has nothing left
                    joining = asyncio.ensure_future(
                        server.wait_for_devices(cfg.min_devices, lambda have: reporter.waiting(have, cfg.min_devices))
                    )
                    try:
                        await asyncio.wait({building, joining}, return_when=asyncio.FIRST_EXCEPTION)
                        if building.done() and building.exception() is not None:
                            building.result()  # raises the model's error
                        await joining
                    finally:
                        joining.cancel()
                model = await building
                if train_cfg.micro_batches == 0:  # --micro-batches auto: from the fleet that joined
                    chosen = await _choose_micro_batches(model, core, train_cfg, cfg, reporter)
                    if chosen is not None:  # the trainer thread has not started: nothing runs parts yet
                        _use_micro_batches(model, chosen[0], core.plan_lanes)
                        reporter.note(chosen[1])
                core.start_training(time.monotonic())  # waiting for devices is not training time
                trainer = asyncio.ensure_future(asyncio.to_thread(train, model))
                try:
                    await asyncio.wait({trainer})  # waiting, unlike awaiting, leaves it running if we are cancelled
                    trainer.result()
                except BaseException:
                    server.abort(Departure.SHUTDOWN)
                    # Let the trainer thread finish what it is doing (a checkpoint, say) and record
                    # it before the store closes; it stops at its next GEMM.
                    await asyncio.wait({trainer}, timeout=60)
                    raise
                bye = core.finish(time.monotonic())  # the job is finished in the books and in status
                final = server.status()  # before the devices disconnect: their live counters
                server.deliver(bye)
                await server.close_all("job finished")
                reporter.finished(results, final)
                if cfg.linger > 0:
                    await _linger(cfg.linger, reporter)
                await server.close_observers("job finished")
            finally:
                ticker.cancel()
                for task in summaries:
                    task.cancel()
                server.stop_verifying()  # before the store closes: a late verdict writes to it
    except BaseException:
        if plan is not None:
            # Resumable if it trained at all (or was resumed); a finished job stays finished.
            plan.books.stopped(clock(), trained=bool(results) or plan.resume is not None)
        raise
    finally:
        if metrics is not None:
            metrics.close()
        if joined is not None:
            if joined.done() and not joined.cancelled() and joined.exception() is None:
                joined.result().close()
            else:
                joined.cancel()
        store.close()
    return JobOutcome(results, final, url, plan.resume.step if plan.resume else None)


async def _summarise(tier: Tier, core: Core, server: Server, url: str, redirect: bool = True) -> None:
    """Keep this rank's summary fresh for the tier (read by its heartbeat thread, which must not
    touch the engine or the store), and the balancer's view of the other ranks' pools: on the
    loop, once a heartbeat."""
    seq, checked, since = 0, server.checked, time.monotonic()
    latest: list[RankSummary] = []
    tier.summary = lambda: latest[-1] if latest else None
    balancer = Balancer(tier.rank, tier.key, url=url)
    core.join_tier(balancer, redirect=redirect)  # newcomers go where the tier needs them; tickets admit
    while True:
        balancer.update(Pool(r, s.url, s.gflops, s.seq, s.admitted) for r, s in tier.summaries().items())
        devices, gflops = core.pool()
        now = time.monotonic()
        rate = (server.checked - checked) / max(now - since, 1e-9)  # results verified a second
        checked, since, seq = server.checked, now, seq + 1
        p = core.progress
        rate = round(min(rate, 1e9), 1)
        summary = RankSummary(seq, p.step, p.state.value, devices, rate, round(gflops, 2), url, balancer.admitted)
        latest[:] = [summary]
        await asyncio.sleep(HEARTBEAT)


async def _join(options: TierOptions, train: TrainConfig, plan: _Plan, reporter: Reporter) -> Tier:
    """Meet the other ranks (blocks until they all came, at most ``--tier-timeout``), prove the
    secret, and agree on where the job stands: every rank must resume from the same step."""
    reporter.note(f"tier: meeting the other ranks at {options.rendezvous} ...")
    tier = await asyncio.to_thread(
        join_tier,
        options.rendezvous,
        options.rank,
        options.world,
        options.secret,
        job_digest(train.to_dict()),
        timeout=options.timeout,
    )
    mine = plan.resume.step if plan.resume else 0
    # Every step this rank could resume from: its checkpoint, the older ones whose files are kept,
    # and the start. The ranks resume from the newest they all hold (ranks checkpoint at the same
    # steps; one killed while writing lacks the newest).
    held = [mine] + [row.step for row in plan.books.checkpoints() if row.step < mine and Path(row.path).exists()]
    held = sorted(set(held[: checkpoint.KEEP] + [0]), reverse=True)
    rows = await asyncio.to_thread(tier.parallel.gather_rows, held, checkpoint.KEEP + 1)
    common = [s for s in held if all(s in row for row in rows)]
    step = int(common[0]) if common else 0
    if any(row[:1] != [step] for row in rows):
        steps = "; ".join(f"rank {r}: {', '.join(str(int(s)) for s in row)}" for r, row in enumerate(rows))
        reporter.note(f"tier: the ranks hold different checkpoints ({steps}); every rank resumes from step {step}")
    if step != mine:
        try:
            state = None
            if step:
                (row,) = [r for r in plan.books.checkpoints() if r.step == step][:1]
                state = await asyncio.to_thread(checkpoint.load, row)
        except (ValueError, CheckpointError) as exc:
            tier.close()
            why = f"this rank cannot load its checkpoint of step {step}, which every rank holds: {exc}"
            raise TierRefused(why) from None
        plan.resume = Resume(step, state, ())
    reporter.note(f"tier: rank {tier.rank} of {tier.world}, every rank proven; from step {step}")
    return tier


def _tokens(cfg: CoordinatorConfig, core: Core, reporter: Reporter) -> tuple[str | None, str | None, tuple[str, ...]]:
    """The join and operator tokens of this start: as given, else the database's (kept: only
    their hashes are stored, so they cannot be printed), else new ones. Returns (join, operator,
    which were generated). Nothing is stored if the two would be equal."""
    gate = core.gate
    join, operator, generated = cfg.token, cfg.operator_token, []
    if join is None and not gate.has_join():
        join = new_token()
        generated.append("join")
    if operator is None and not gate.has_operator():
        operator = new_token()
        generated.append("operator")
    if gate.would_collide(join=join, operator=operator):
        raise ConfigError("the operator token must differ from the join token")
    gate.set_tokens(join=join, operator=operator)
    for which, token in (("join", cfg.token), ("operator", cfg.operator_token)):
        if token is not None and len(token) < STRONG_TOKEN:
            reporter.note(
                f"the {which} token is short ({len(token)} characters): anyone who copies the database "
                f"could search for it; generated tokens have 22"
            )
    return join, operator, tuple(generated)


async def _linger(seconds: float, reporter: Reporter) -> None:
    """Keep serving a finished job's final state; Ctrl-C ends the wait early, not the job (it is
    finished in the books already)."""
    reporter.note(
        f"the job is finished: its page, cleave status and /metrics stay up for {seconds:g} s "
        "(Ctrl-C exits now; --linger 0 exits at once)"
    )
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:  # Ctrl-C: asyncio.run cancels us; returning ends the run normally
        current = asyncio.current_task()
        uncancel = getattr(current, "uncancel", None)  # Python 3.11+; 3.10 has no cancel count
        if uncancel is not None:
            uncancel()


def run_job(cfg: CoordinatorConfig, reporter: Reporter) -> JobOutcome:
    return asyncio.run(serve_job(cfg, reporter))
