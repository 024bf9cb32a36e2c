"""What each device can do, measured live: GEMM speed, links, round trip, reliability, memory.

Pure: observations and the injected clock in, a ``costmodel.Profile`` out. ``Core`` records one
observation per verified result (and one per lease that ends without one); the cost planner
reads the profiles; ``cleave status --json`` shows them.

Every estimate is a time-decayed mean (``Ema``): an observation ``age`` seconds old weighs
``exp(-age / tau)``, and the sum is divided by the total weight, so the first observation is the
estimate (no bias towards an initial zero) and old ones fade on the injected clock.

Links without synchronised clocks: the coordinator times each lease itself, from handing the
``work`` to the writer to receiving its ``result`` (its turnaround ``T``). The device reports how
long the matmul took (``seconds``) and how long the tile waited before it (``waited``); what is
left, ``T - waited - seconds``, is the link's share: one round trip plus ``down`` bytes at the
downlink rate plus ``up`` bytes at the uplink rate. Many leases with different mixes of bytes
(blocks a device already holds are not sent again; a dW partial is larger than a forward tile)
make that a least-squares problem in ``(rtt, 1/down, 1/up)``, solved over decayed sums with a
weak prior (``LinkFit``). The device's claims only apportion the coordinator's own measurement:
they are clamped to ``[0, T]``, and ``Core`` believes a wait only up to the arrival of the
device's previous result (a tile waits only behind earlier work). A device that under-reports
``seconds`` is still planned at no more than ``SEEN_FACTOR`` times the rate the coordinator sees
it deliver; and the plan is only advice about who does what (docs/security.md, "Liveness").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cleave.coordinator.planning.costmodel import ITEMSIZE, Profile, PSProfile

TAU = 120.0  # seconds: an observation this old weighs 1/e
MB = 1e6  # link features are in megabytes, so the fit's coefficients are seconds per MB
# Priors, used until measurements outweigh them: a home broadband line and a modest CPU.
PRIOR_DOWN = 25e6  # bytes/s (200 Mbit/s)
PRIOR_UP = 5e6  # bytes/s (40 Mbit/s)
PRIOR_RTT = 0.03  # seconds
PRIOR_WEIGHT = 0.02  # observations' worth of belief in the priors: directions the data leave open keep them
PRIOR_MEMORY = 1 << 30  # bytes for blocks, when the device states no budget
# The most a device is planned to hold for its units in flight (two): a unit's blocks travel in
# one work frame, and the server cuts a peer with more than ``Limits.outbound_queue`` (64 MiB)
# queued for it, and one that asks for more than ``Limits.resends`` (32 MiB burst) again.
MAX_UNIT_MEMORY = 32 << 20
LINK_BOUNDS = (1e4, 1e11)  # bytes/s: estimates are clamped to this (10 kB/s .. 100 GB/s)
# A unit's fixed cost on the device (decode, launch, encode) is at most this: the rest of the
# fitted intercept is latency, which prefetching hides.
DEVICE_OVERHEAD = 0.002
# A device is planned at most this many times the rate the coordinator sees it deliver (work
# per turnaround, links included): a device reporting tiny matmul times is not believed beyond.
SEEN_FACTOR = 4.0
MEASURED_GFLOPS = (0.01, 1e5)  # a device's measured rate is clamped to this
# A device's claimed rate (its benchmark at join) only sets its first deadlines and plan, within
# these bounds, and until it has returned work it is taken to be UNPROVEN_FACTOR times slower.
CLAIM_GFLOPS = (1.0, 1e5)
UNPROVEN_FACTOR = 4.0


@dataclass
class Ema:
    """A time-decayed, bias-corrected mean."""

    tau: float = TAU
    value: float = 0.0
    weight: float = 0.0
    at: float = -math.inf

    def add(self, x: float, now: float, weight: float = 1.0) -> None:
        """One observation ``x`` at ``now``."""
        decay = math.exp(-max(0.0, now - self.at) / self.tau) if self.weight else 0.0
        self.weight = self.weight * decay + weight
        self.value += (x - self.value) * weight / self.weight
        self.at = max(self.at, now)

    @property
    def seen(self) -> bool:
        """Whether any observation was made."""
        return self.weight > 0


@dataclass
class LinkFit:
    """Least squares for ``t = rtt + down_mb / D + up_mb / U`` over time-decayed sums, with a
    ridge prior pulling each coefficient to its prior value with ``PRIOR_WEIGHT``."""

    tau: float = TAU
    prior: tuple[float, float, float] = (PRIOR_RTT, MB / PRIOR_DOWN, MB / PRIOR_UP)
    xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    xy: list[float] = field(default_factory=lambda: [0.0] * 3)
    weight: float = 0.0
    at: float = -math.inf

    def add(self, down_bytes: float, up_bytes: float, seconds: float, now: float) -> None:
        """One lease's link time: ``seconds`` to move ``down_bytes`` and ``up_bytes``."""
        decay = math.exp(-max(0.0, now - self.at) / self.tau) if self.weight else 0.0
        x = (1.0, down_bytes / MB, up_bytes / MB)
        for i in range(3):
            self.xy[i] = self.xy[i] * decay + x[i] * seconds
            for j in range(3):
                self.xx[i][j] = self.xx[i][j] * decay + x[i] * x[j]
        self.weight = self.weight * decay + 1.0
        self.at = max(self.at, now)

    def solve(self) -> tuple[float, float, float]:
        """(rtt seconds, down bytes/s, up bytes/s)."""
        # Ridge towards the prior: minimise |X b - t|^2 + w |b - prior|^2 (per coefficient,
        # scaled to the features' typical size so the prior is equally weak on each).
        xx, xy, prior = np.array(self.xx), np.array(self.xy), np.array(self.prior)
        ridge = PRIOR_WEIGHT * np.maximum(1e-12, np.diag(xx) / max(self.weight, 1e-12))
        a, b = xx + np.diag(ridge), xy + ridge * prior
        coef = _solve(a, b) if self.weight else prior
        if coef[0] < 0:  # a negative latency is a collinear fit: solve again with none
            coef = np.concatenate(([0.0], _solve(a[1:, 1:], b[1:])))
        if not np.isfinite(coef).all():
            coef = prior
        rtt = min(max(float(coef[0]), 0.0), 10.0)
        lo, hi = LINK_BOUNDS
        down = min(max(MB / coef[1], lo), hi) if coef[1] > 0 else hi
        up = min(max(MB / coef[2], lo), hi) if coef[2] > 0 else hi
        return rtt, float(down), float(up)


def _solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    try:
        return np.linalg.solve(a, b)
    except np.linalg.LinAlgError:  # singular: no answer (the caller falls back to the prior)
        return np.full(len(b), np.nan)


@dataclass
class DeviceProfile:
    """One device's measured profile (its claims are only the starting point)."""

    claimed_gflops: float  # its benchmark at join, bounded
    memory: int  # bytes it gives to blocks and results
    gflops: Ema = field(default_factory=Ema)
    seen_rate: Ema = field(default_factory=Ema)  # GFLOP/s over the coordinator's own turnarounds
    link: LinkFit = field(default_factory=LinkFit)
    kept: Ema = field(default_factory=Ema)  # 1 per verified result, 0 per lease lost, revoked, rejected
    results: int = 0

    def __post_init__(self) -> None:
        lo, hi = CLAIM_GFLOPS
        self.claimed_gflops = min(max(self.claimed_gflops, lo), hi)

    def verified(
        self,
        flops: float,
        compute: float,
        waited: float,
        turnaround: float,
        down_bytes: float,
        up_bytes: float,
        now: float,
    ) -> None:
        """A verified result: ``turnaround`` is the coordinator's own measurement; ``compute``
        and ``waited`` are the device's claims, trusted only within it."""
        turnaround = max(turnaround, 1e-9)
        compute = min(max(compute, 0.0), turnaround)
        waited = min(max(waited, 0.0), turnaround - compute)
        lo, hi = MEASURED_GFLOPS
        if compute > 0:
            self.gflops.add(min(max(flops / compute / 1e9, lo), hi), now)
        self.seen_rate.add(min(max(flops / (turnaround - waited) / 1e9, lo), hi), now)
        self.link.add(down_bytes, up_bytes, turnaround - compute - waited, now)
        self.kept.add(1.0, now)
        self.results += 1

    def failed(self, now: float) -> None:
        """A lease ended without a verified result (lost, taken back, rejected)."""
        self.kept.add(0.0, now)

    def measured_gflops(self, claimed: float) -> float:
        """Its matmul rate as measured from verified results, else ``claimed`` (for display)."""
        return self.gflops.value if self.gflops.seen else claimed

    def profile(self, dtype: str = "fp32") -> Profile:
        """Its profile in ``dtype`` (the job's: the one its tiles are measured in)."""
        rtt, down, up = self.link.solve()
        # Until it has returned work, a device is planned UNPROVEN_FACTOR times below its (bounded) claim.
        rate = self.gflops.value if self.gflops.seen else self.claimed_gflops / UNPROVEN_FACTOR
        if self.seen_rate.seen:  # its claimed matmul time may flatter it; what it delivers may not
            rate = min(rate, SEEN_FACTOR * self.seen_rate.value)
        reliability = self.kept.value if self.kept.seen else 1.0
        return Profile(
            gflops={dtype: rate},
            memory=min(self.memory, MAX_UNIT_MEMORY),
            down=down,
            up=up,
            rtt=rtt,
            reliability=min(1.0, max(0.0, reliability)),
            overhead=min(rtt, DEVICE_OVERHEAD),
        )

    def as_json(self, dtype: str = "fp32") -> dict[str, float | int | None]:
        """The profile as ``status --json`` shows it (``devices[].profile``). A link figure not
        measured yet (no verified result), or beyond what the fit resolves (at its bound), is
        None: the planner then uses its prior, which is no measurement to show."""
        p = self.profile(dtype)
        fitted = self.link.weight > 0

        def rate(bytes_per_s: float) -> float | None:
            return round(bytes_per_s * 8 / 1e6, 3) if fitted and LINK_BOUNDS[0] < bytes_per_s < LINK_BOUNDS[1] else None

        return {
            "gflops": round(p.gflops[dtype], 3),
            "down_mbps": rate(p.down),
            "up_mbps": rate(p.up),
            "rtt_ms": round(p.rtt * 1e3, 3) if fitted else None,
            "reliability": round(p.reliability, 4),
            "memory_bytes": p.memory,
            "measured_results": self.results,
        }


# --------------------------------------------------------------------------- the PS, measured


def measure_ps(
    link_gbps: float,
    *,
    dtype: str = "fp32",
    seconds: float = 0.3,
    clock: Callable[[], float] = time.perf_counter,
    device: Any = None,
) -> PSProfile:
    """The coordinator's own profile, measured here in about ``seconds``: its GEMM rate in the
    job's dtype on ``device`` (a ``torch.device``; the CPU by default: where the trainer
    multiplies the GEMMs it keeps), its verification rate (the 16-vector check is a skinny GEMM)
    and its memory bandwidth (assembly, partial sums), both on the host where tiles arrive. The
    link is the operator's ``--ps-link-gbps``."""
    import torch

    device = device or torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    from cleave.coordinator.planning.costmodel import VERIFY_ROUNDS

    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    n = 512
    a, b = torch.randn(n, n, dtype=tdtype), torch.randn(n, n, dtype=tdtype)
    r = torch.randn(n, VERIFY_ROUNDS)
    big = torch.empty(4 << 20)  # 16 MB: past the caches
    budget = seconds / 3

    def rate(fn: Callable[[], object], work: float) -> float:
        fn()
        count, started = 0, clock()
        while True:
            fn()
            count += 1
            elapsed = clock() - started
            if elapsed >= budget or count >= 1000:
                return work * count / max(elapsed, 1e-9)

    if device.type == "cuda":  # big enough to show a GPU's rate, not its launch latency
        big_n = 4096
        ga, gb = (torch.randn(big_n, big_n, dtype=tdtype, device=device) for _ in range(2))
        gemm = rate(lambda: (ga @ gb, sync()), 2.0 * big_n**3)
    else:
        gemm = rate(lambda: a @ b, 2.0 * n**3)
    af, bf, cf = a.float(), b.float(), (a @ b).float()
    verify = rate(lambda: (af @ (bf @ r)) - cf @ r, 2.0 * VERIFY_ROUNDS * 3 * n * n)
    copy = rate(lambda: big.clone(), 2.0 * big.numel() * big.element_size())
    defaults = PSProfile()
    gflops = {d: (gemm / 1e9 if d == dtype else defaults.gflops.get(d, 0.0)) for d in ITEMSIZE}
    return PSProfile.from_link(
        link_gbps, gflops=gflops, verify_flops=verify, memory_bw=copy, unit_overhead=defaults.unit_overhead
    )
