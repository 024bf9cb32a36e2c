"""The coordinator's options (those of ``cleave coordinator start``), each checked once, here.

A bad value is a ConfigError that names the field as the Python API spells it (``port``); the CLI
maps the field to its flag (cleave_cli/options.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from cleave.coordinator.engine.energy import GRID_GCO2_KWH
from cleave.coordinator.engine.limits import Limits, TrustPolicy
from cleave.coordinator.engine.live_plan import Planner
from cleave.coordinator.engine.scheduler import FaultPolicy
from cleave.coordinator.engine.standby import StandbyPolicy
from cleave.coordinator.planning.costmodel import MAX_PS_GFLOPS
from cleave.coordinator.planning.tiles import TilingPolicy
from cleave.coordinator.tier.group import TIER_TIMEOUT
from cleave.coordinator.training import models
from cleave.coordinator.training.hardware import DEVICES
from cleave.coordinator.training.loop import TrainConfig
from cleave.wire.addresses import url_host
from cleave.wire.errors import ConfigError
from cleave.wire.messages import MAX_GRID, MAX_TOKEN, MAX_URL, WireDtype

# One thread beside the loop writes work frames' bytes to the sockets: the loop's CPU a tile fell
# 40-70% on Llama-2-7B tiles (bench/bench_tax.py --send-threads 0 1); more pay on many cores.
DEFAULT_SEND_THREADS = 1
MAX_SEND_THREADS = 64
LINGER = 300.0  # seconds ``cleave coordinator start`` keeps a finished job visible by default
MAX_LINGER = 7 * 86_400


@dataclass(frozen=True)
class CoordinatorConfig:
    """The coordinator's options: those of ``cleave coordinator start``, and a model factory."""

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
        url, certfile, keyfile = self.public_url, self.certfile, self.keyfile
        checks = [
            (0 <= self.port <= 65535, "port", f"must be between 0 and 65535, got {self.port}"),
            (
                url is None
                or (
                    url.startswith(("ws://", "wss://")) and url_host(url) and len(url) <= MAX_URL and url.isprintable()
                ),
                "public_url",
                f"must be ws://HOST[:PORT] or wss://... (at most {MAX_URL} characters), got {url!r}",
            ),
            (
                0 <= self.min_devices <= 100_000,
                "min_devices",
                f"must be between 0 and 100000, got {self.min_devices}",
            ),
            *(
                (
                    value is None or bool(value.strip() and value.isprintable() and len(value) <= MAX_TOKEN),
                    name,
                    f"must be 1 to {MAX_TOKEN} printable characters",
                )
                for name, value in (("token", self.token), ("operator_token", self.operator_token))
            ),
            (
                self.token is None or self.token != self.operator_token,
                "operator_token",
                "must differ from the join token",
            ),
            (
                (certfile is None) == (keyfile is None),
                "keyfile" if keyfile is None else "certfile",
                "is needed too: a certificate chain and its private key go together",
            ),
            (
                0.001 <= self.ps_link_gbps <= 10_000,
                "ps_link_gbps",
                f"must be between 0.001 and 10000, got {self.ps_link_gbps}",
            ),
            (
                self.ps_gflops is None or 0.001 <= self.ps_gflops <= MAX_PS_GFLOPS,
                "ps_gflops",
                f"must be between 0.001 and {MAX_PS_GFLOPS:,.0f}, got {self.ps_gflops}",
            ),
            (0 <= self.linger <= MAX_LINGER, "linger", f"must be between 0 and {MAX_LINGER:,} s, got {self.linger:g}"),
            (
                0 <= self.checkpoint_every <= 10_000_000,
                "checkpoint_every",
                f"must be between 0 and 10,000,000, got {self.checkpoint_every}",
            ),
            (
                0 <= self.prune_steps <= 10_000_000,
                "prune_steps",
                f"must be between 0 and 10,000,000, got {self.prune_steps}",
            ),
            (
                not self.prune_steps or self.checkpoint_every > 0,
                "prune_steps",
                "prunes at each checkpoint, and checkpoints are off",
            ),
            (
                (self.model_factory is not None) == models.is_custom(self.train.model),
                "model_factory",
                "goes with a model named custom:LABEL, and only with one",
            ),
            (
                math.isfinite(self.grid_gco2_kwh) and 0 <= self.grid_gco2_kwh <= MAX_GRID,
                "grid_gco2_kwh",
                f"must be between 0 and {MAX_GRID:g}, got {self.grid_gco2_kwh:g}",
            ),
            (
                0 <= self.send_threads <= MAX_SEND_THREADS,
                "send_threads",
                f"must be between 0 and {MAX_SEND_THREADS}, got {self.send_threads}",
            ),
            (
                self.device.lower() in DEVICES,
                "device",
                f"must be one of {', '.join(DEVICES)}, got {self.device!r}",
            ),
        ]
        for ok, name, detail in checks:
            if not ok:
                raise ConfigError(detail, field=name)


@dataclass(frozen=True)
class TierOptions:
    """One rank of a job across several coordinators (``--world-size``, ``--rank``,
    ``--rendezvous``, the tier's secret, ``--tier-timeout`` and ``--redirect``)."""

    rendezvous: str
    rank: int | None
    world: int | None
    secret: str = field(repr=False)
    timeout: float = TIER_TIMEOUT
    redirect: bool = True  # send newcomers to the rank whose pool is weakest (tickets are admitted either way)

    def __post_init__(self) -> None:
        if not 1.0 <= self.timeout <= 3600:
            raise ConfigError(f"must be between 1 and 3600 s, got {self.timeout:g}", field="TierOptions.timeout")
