"""Emulated volunteer devices: a fleet of them in one process, for ``cleave emulate``.

Each device is the real client (client/runner.py ``Worker``) on its own real websocket, with its
own identity and credential, speaking the real protocol and computing every tile for real (so
training stays exact), but paced to a device profile of a fleet (coordinator/whatif/presets.py
``resolve_fleet``: a preset or a TOML fleet file). Emulated devices skip the benchmark and the
owner's idle/power rules (they are always idle and on mains) and claim their profile's rate.
All devices share one asyncio loop, and their real products go through a small shared pool
(``compute_threads``, default 1) of one-thread torch, since pacing, not the host, sets the pace.

Pacing model
------------
Times are seconds on the monotonic clock (the ``Fleet``'s ``clock``, which its workers and pacers
share). A device of profile ``p`` emulated at ``--speed X`` (a slow-motion factor: every duration
is X times the profile's) has, in the job's dtype::

    F = p.gflops[dtype] * 1e9 / X    FLOP/s        D = p.down / X,  U = p.up / X    bytes/s
    L = p.rtt * X / 2                one-way latency, seconds
    O = p.overhead * X               seconds per tile besides the product

and three serial resources, each with the time it is next free (at first: never busy).

Downlink. A work frame of ``B`` bytes (its whole size on the wire: the blocks it carries and a
header) really arrives at ``t_recv`` (the coordinator's socket on this host delivered it at once)::

    down_start = max(t_recv, down_free)
    down_free  = down_start + B / D          # the link is busy for B / D
    ready      = down_free + L               # latency is paid once per message and overlaps

Compute. Tiles in the order they arrived::

    start        = max(ready, compute_free)
    end          = max(start + flops / F + O, real_end)      # flops = 2 m k n
    compute_free = end

where the real product runs from ``start`` and finishes at ``real_end``. When
``real_end > start + flops / F + O`` the host was too slow for the profile: the real time
counts and the device counts an *overrun* (lower the fleet's rates or raise --speed). The result
reports ``seconds = end - start`` and ``waited = start - ready`` (its time queued on the device
behind other tiles, which the coordinator does not count as link time).

Uplink. The result frame of ``R`` bytes, ready at ``end``::

    up_start = max(end, up_free)
    up_free  = up_start + R / U
    sent_at  = up_free + L                   # written to the socket then; the coordinator reads it at once

Nothing else is paced: heartbeats, releases, cancels and credit messages go at once.

Churn and byzantine devices
---------------------------
With ``leave_rate`` R (per device per minute), each device leaves after an exponential time of
mean 60 / R seconds while it runs, stays away an exponential time of mean ``away_seconds``, and
comes back with its credential (the same identity). Half of the leaves (by the device's seeded
generator) are graceful: a Leave message and a close frame. The other half are crashes: the
connection goes silent, with no Leave, no close frame and no FIN (the socket is kept open, unread,
while the device is away, then reset), so the coordinator learns of it by heartbeat timeout, or
from the reset when the device comes back first. A ``byzantine`` share of the devices (chosen by
the seed; at least one when the share is above 0) returns every result forged
(emulator/forgeries.py: a kind drawn per result, ``magnitude`` times the detection threshold);
the coordinator should ban each at its first forged result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import os
import shutil
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from cleave.client.idle import Reading
from cleave.client.policy import PolicyConfig
from cleave.client.runner import EXIT_BANNED, Worker, WorkerConfig, WorkerStats
from cleave.client.state import WorkerState
from cleave.coordinator.planning.costmodel import DeviceClass, Profile
from cleave.emulator.forgeries import FORGERIES, NON_FINITE, SCALABLE, HonestWithinTolerance
from cleave.wire.codes import Name
from cleave.wire.errors import ClientError, ConfigError
from cleave.wire.messages import MAX_NAME

log = logging.getLogger("cleave.emulator")

T = TypeVar("T")
Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]

# Forgeries a byzantine device draws from: every scalable kind, the non-finite ones and the
# fixed-size ones that need no memory of earlier tiles.
BYZANTINE_KINDS: tuple[str, ...] = tuple(
    sorted(SCALABLE | NON_FINITE | {"zeros", "swap_rows", "swap_cols", "previous_batch", "replay"})
)
# Worker states after the Welcome.
CONNECTED = frozenset({WorkerState.WAITING, WorkerState.WORKING, WorkerState.PAUSED, WorkerState.STANDBY})


class Fate(Name):
    """An emulated device's state besides its worker's (``WorkerState``): why it is not working."""

    AWAY = "away"  # left, to come back later
    BANNED = "banned"
    FINISHED = "finished"  # the job is complete
    STOPPED = "stopped"
    FAILED = "failed"  # its worker failed (the error says why)


# --------------------------------------------------------------------------- pacing


@dataclass
class Pacing:
    """The pacing model's arithmetic for one device (module docstring): no clock, no sleeping."""

    flops_per_s: float  # F
    down: float  # D, bytes/s
    up: float  # U, bytes/s
    latency: float  # L = rtt / 2, seconds
    overhead: float = 0.0  # O, seconds per tile
    down_free: float = -math.inf
    compute_free: float = -math.inf
    up_free: float = -math.inf

    @classmethod
    def from_profile(cls, profile: Profile, dtype: str = "fp32", speed: float = 1.0) -> Pacing:
        rate = profile.flops_per_s(dtype)
        if rate <= 0:
            raise ConfigError(f"the profile has no {dtype} rate: it cannot compute the job's tiles")
        if not (math.isfinite(speed) and speed > 0):
            raise ConfigError(f"--speed must be a positive number, got {speed}")
        return cls(
            flops_per_s=rate / speed,
            down=profile.down / speed,
            up=profile.up / speed,
            latency=profile.rtt * speed / 2,
            overhead=profile.overhead * speed,
        )

    def download(self, nbytes: int, t_recv: float) -> float:
        """A work frame of ``nbytes`` arrived at ``t_recv``: when its blocks are usable."""
        self.down_free = max(t_recv, self.down_free) + nbytes / self.down
        return self.down_free + self.latency

    def start(self, ready: float) -> float:
        """When a tile usable at ``ready`` starts computing (after the tiles before it)."""
        return max(ready, self.compute_free)

    def compute_seconds(self, flops: float) -> float:
        return flops / self.flops_per_s + self.overhead

    def computed(self, start: float, flops: float, real_end: float) -> tuple[float, bool]:
        """The real product started at ``start`` ended at ``real_end``: (the paced end, overrun?)."""
        paced = start + self.compute_seconds(flops)
        end = max(paced, real_end)
        self.compute_free = end
        return end, real_end > paced

    def upload(self, nbytes: int, ready: float) -> float:
        """A result of ``nbytes`` ready at ``ready``: when it reaches the coordinator."""
        self.up_free = max(ready, self.up_free) + nbytes / self.up
        return self.up_free + self.latency


class Pacer:
    """``client.runner.Pacer`` over ``Pacing``: reads the clock, sleeps, and counts."""

    def __init__(self, pacing: Pacing, clock: Clock = time.monotonic, sleep: Sleep = asyncio.sleep) -> None:
        self.pacing = pacing
        self._clock, self._sleep = clock, sleep
        self.overruns = 0
        self.tiles = 0  # products paced
        self.paced_seconds = 0.0  # compute seconds reported
        self.down_bytes = 0
        self.up_bytes = 0

    async def _until(self, when: float) -> None:
        delay = when - self._clock()
        if delay > 0:
            await self._sleep(delay)

    def arrived(self, nbytes: int) -> float:
        self.down_bytes += nbytes
        return self.pacing.download(nbytes, self._clock())

    async def start(self, ready: float) -> float:
        start = self.pacing.start(ready)
        await self._until(start)
        return start

    async def finish(self, start: float, flops: float) -> float:
        end, overrun = self.pacing.computed(start, flops, self._clock())
        self.overruns += overrun
        self.tiles += 1
        await self._until(end)
        self.paced_seconds += end - start
        return end - start

    def deliver_at(self, nbytes: int) -> float:
        self.up_bytes += nbytes
        return self.pacing.upload(nbytes, self._clock())


# --------------------------------------------------------------------------- compute


class SharedCompute:
    """The real products of every device, at most ``threads`` at a time (one-thread torch each),
    on ``threads`` threads kept for the fleet's life. Not on the calling worker's own thread: a
    rejoin is a new ``Worker`` with a new pool thread, and products on a fresh thread at every
    rejoin grew the emulator's RSS by about 15 MB per 100 rejoins, without end (memory that
    malloc_trim gives back: native heap left behind by exited threads, not Python objects). At
    most ``threads`` compute threads for the fleet's life, whatever the churn."""

    def __init__(self, threads: int = 1) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="cleave-emulate")

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on one of the shared threads (the caller's thread waits)."""
        return self._pool.submit(fn, *args).result()

    @staticmethod
    def _product(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, float]:
        started = time.perf_counter()
        c = a @ b
        return c, time.perf_counter() - started

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, float]:
        return self.run(self._product, a, b)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Forger:
    """A byzantine device's compute: the real product, then a forgery of it (a kind per result)."""

    def __init__(self, compute: SharedCompute, rng: np.random.Generator, magnitude: float) -> None:
        self.compute, self.rng, self.magnitude = compute, rng, magnitude
        self.kinds: Counter[str] = Counter()

    @property
    def forged(self) -> int:
        return sum(self.kinds.values())

    def forge(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        for i in self.rng.permutation(len(BYZANTINE_KINDS)):
            kind = BYZANTINE_KINDS[int(i)]
            try:
                forged = FORGERIES[kind](a, b, c, self.rng, self.magnitude)
            except HonestWithinTolerance:  # this one would not be a forgery here: another kind
                continue
            self.kinds[kind] += 1
            return forged
        raise AssertionError("unreachable: a NaN is always a forgery")

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, float]:
        c, seconds = self.compute(a, b)
        return self.compute.run(self.forge, a, b, c), seconds  # torch work too: on the shared threads


class _QuietProbe:
    """Emulated devices are always idle and on mains."""

    def read(self) -> Reading:
        return Reading()


# --------------------------------------------------------------------------- the fleet


@dataclass(frozen=True)
class FleetConfig:
    url: str
    token: str
    classes: tuple[DeviceClass, ...]  # already scaled to the number of devices (resolve_fleet)
    dtype: str = "fp32"
    speed: float = 1.0
    leave_rate: float = 0.0  # leaves per device per minute
    away_seconds: float = 10.0  # mean time away after a leave
    byzantine: float = 0.0  # share of devices that forge
    seed: int = 0
    magnitude: float = 4.0  # forged errors, in detection thresholds
    compute_threads: int = 1
    slots: int = 2
    cafile: str | None = None
    insecure: bool = False
    backoff_max: float = 5.0
    finish_grace: float = 5.0  # seconds the others get to hear "finished" after the first did

    def __post_init__(self) -> None:
        checks = [
            (sum(c.count for c in self.classes) >= 1, "the fleet has no devices"),
            (
                math.isfinite(self.leave_rate) and 0 <= self.leave_rate <= 600,
                f"--leave-rate must be between 0 and 600 per minute, got {self.leave_rate}",
            ),
            (
                math.isfinite(self.away_seconds) and 0 < self.away_seconds <= 86400,
                f"--away-seconds must be above 0 and at most 86400, got {self.away_seconds}",
            ),
            (0 <= self.byzantine <= 1, f"--byzantine must be a share between 0 and 1, got {self.byzantine}"),
            (
                math.isfinite(self.speed) and 0 < self.speed <= 1e6,
                f"--speed must be above 0 and at most 1e6, got {self.speed}",
            ),
            (1 <= self.compute_threads <= 64, f"--threads must be between 1 and 64, got {self.compute_threads}"),
            (self.magnitude > 0, "the forgery magnitude must be positive"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def devices(self) -> int:
        return sum(c.count for c in self.classes)


@dataclass
class EmulatedDevice:
    index: int
    name: str
    cls: str
    profile: Profile
    pacer: Pacer
    rng: np.random.Generator
    credentials: Path
    forger: Forger | None = None
    state: str = WorkerState.STARTING  # its worker's (a WorkerState), or its Fate
    identity: int | None = None
    worker: Worker | None = None
    leaves_graceful: int = 0
    leaves_crash: int = 0
    rejoins: int = 0
    error: str = ""
    # Counters of its finished workers (a rejoin is a new Worker); ``count`` adds the live one.
    done: dict[str, int] = field(default_factory=lambda: dict(tiles=0, rejected=0, bytes_down=0, bytes_up=0))

    @property
    def byzantine(self) -> bool:
        return self.forger is not None

    @property
    def connected(self) -> bool:
        return self.worker is not None and self.state in CONNECTED

    def count(self, key: str) -> int:
        live = getattr(self.worker.stats, key) if self.worker is not None else 0
        return self.done[key] + live

    def retire(self, worker: Worker) -> None:
        for key in self.done:
            self.done[key] += getattr(worker.stats, key)
        if worker.stats.identity is not None:
            self.identity = worker.stats.identity
        if self.worker is worker:
            self.worker = None

    def as_json(self) -> dict:
        return {
            "name": self.name,
            "class": self.cls,
            "byzantine": self.byzantine,
            "state": self.state,
            "identity": self.identity,
            "tiles": self.count("tiles"),
            "rejected": self.count("rejected"),
            "forged": self.forger.forged if self.forger else 0,
            "forgeries": dict(sorted(self.forger.kinds.items())) if self.forger else {},
            "overruns": self.pacer.overruns,
            "paced_compute_s": round(self.pacer.paced_seconds, 4),
            "bytes_down": self.count("bytes_down"),
            "bytes_up": self.count("bytes_up"),
            "leaves": self.leaves_graceful + self.leaves_crash,
            "crashes": self.leaves_crash,
            "rejoins": self.rejoins,
            "error": self.error,
        }


def device_name(cls: str, index: int) -> str:
    tail = f"-{index}"
    return f"emu-{cls}"[: MAX_NAME - len(tail)] + tail


def byzantine_indices(devices: int, share: float, seed: int) -> set[int]:
    """Which devices forge: ``round(share * devices)`` of them, at least one when share > 0."""
    if share <= 0 or devices < 1:
        return set()
    count = min(devices, max(1, round(share * devices)))
    return {int(i) for i in np.random.default_rng([seed, 0xB12]).choice(devices, size=count, replace=False)}


class Fleet:
    """Run every device until the coordinator finishes the job, ``request_stop``, or a fatal error.
    ``clock`` (monotonic seconds) is the time of every device's worker and pacer, and of the report."""

    def __init__(self, cfg: FleetConfig, clock: Clock = time.monotonic) -> None:
        self.cfg = cfg
        self._clock = clock
        self.compute = SharedCompute(cfg.compute_threads)
        self._dir = Path(tempfile.mkdtemp(prefix="cleave-emulate-"))  # one credentials file per device
        bad = set(byzantine_indices(cfg.devices, cfg.byzantine, cfg.seed))
        self.devices: list[EmulatedDevice] = []
        for cls in cfg.classes:
            for _ in range(cls.count):
                i = len(self.devices)
                rng = np.random.default_rng([cfg.seed, i + 1])
                try:
                    pacer = Pacer(Pacing.from_profile(cls.profile, cfg.dtype, cfg.speed), clock)
                except ValueError as exc:
                    raise ConfigError(f"fleet class {cls.name!r}: {exc}") from None
                forger = (
                    Forger(self.compute, np.random.default_rng([cfg.seed, i + 1, 0xF0]), cfg.magnitude)
                    if i in bad
                    else None
                )
                self.devices.append(
                    EmulatedDevice(
                        i, device_name(cls.name, i), cls.name, cls.profile, pacer, rng, self._dir / f"{i}.json", forger
                    )
                )
        try:  # a bad URL, token or --cafile is every device's: refused here, once (ClientError)
            Worker(self._worker_config(self.devices[0]), probe=_QuietProbe(), clock=clock)
        except ClientError:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self.finished = False
        self.fatal: ClientError | None = None
        self.started = clock()
        self.ended: float | None = None
        self._stop: asyncio.Event | None = None  # every device leaves
        self._over: asyncio.Event | None = None  # ... or the job is over: nobody comes back
        self._stopping = False
        self._held: dict[int, socket.socket] = {}  # crashed devices' silent sockets

    # ---------------------------------------------------------------- control

    def request_stop(self) -> None:
        """Stop every device (graceful leaves); ``run`` returns once they are gone."""
        self._stopping = True
        if self._stop is not None and self._over is not None:
            self._stop.set()
            self._over.set()

    async def run(self) -> dict:
        self._stop, self._over = asyncio.Event(), asyncio.Event()
        if self._stopping:
            self._stop.set()
            self._over.set()
        self.started = self._clock()
        try:
            await asyncio.gather(*(self._life(dev) for dev in self.devices))
        finally:
            for sock in self._held.values():
                sock.close()
            self._held.clear()
            self.compute.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            self.ended = self._clock()
        if self.fatal is not None and not self.finished:
            raise self.fatal
        return self.summary()

    def _worker_config(self, dev: EmulatedDevice) -> WorkerConfig:
        cfg = self.cfg
        memory_mb = min(max(1, dev.profile.memory >> 20), 10_000_000)
        return WorkerConfig(
            url=cfg.url,
            token=cfg.token,
            name=dev.name,
            device="cpu",
            threads=1,
            slots=cfg.slots,
            once=True,
            backoff_max=cfg.backoff_max,
            benchmark_seconds=0.0,
            poll_seconds=60.0,
            policy=dataclasses.replace(PolicyConfig.always(), max_memory_mb=memory_mb),
            cafile=cfg.cafile,
            insecure=cfg.insecure,
            credentials=dev.credentials,
        )

    def _worker(self, dev: EmulatedDevice) -> Worker:
        wcfg = self._worker_config(dev)

        def update(stats: WorkerStats) -> None:
            if dev.worker is worker:  # not a worker that has left
                dev.state = stats.state
                if stats.identity is not None:
                    dev.identity = stats.identity

        worker = Worker(
            wcfg,
            compute=dev.forger or self.compute,
            probe=_QuietProbe(),
            on_update=update,
            pacer=dev.pacer,
            clock=self._clock,
        )
        # Its hello claims the profile's rate, as a benchmark of that device would have measured.
        worker.stats.benchmark_gflops = dev.pacer.pacing.flops_per_s / 1e9
        return worker

    async def _life(self, dev: EmulatedDevice) -> None:
        assert self._stop is not None and self._over is not None
        rate = self.cfg.leave_rate / 60.0  # per second
        while not self._stop.is_set():
            worker = self._worker(dev)
            dev.worker, dev.state = worker, WorkerState.STARTING
            task = asyncio.create_task(worker.run())
            stop = asyncio.create_task(self._stop.wait())
            stay = float(dev.rng.exponential(1 / rate)) if rate > 0 else None
            done, _ = await asyncio.wait({task, stop}, timeout=stay, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if task in done:
                self._ended(dev, worker, task)
                return
            if self._stop.is_set():
                worker.request_stop()
                await self._settle(task)
                dev.retire(worker)
                dev.state = Fate.FINISHED if self.finished else Fate.STOPPED
                return
            crashed = await self._leave(dev, worker, task, crash=bool(dev.rng.random() < 0.5))
            away = float(dev.rng.exponential(self.cfg.away_seconds))
            log.info("%s %s; back in %.1f s", dev.name, "crashed" if crashed else "left", away)
            dev.state = Fate.AWAY
            try:
                await asyncio.wait_for(self._over.wait(), away)
            except (TimeoutError, asyncio.TimeoutError):
                pass
            held = self._held.pop(dev.index, None)
            if held is not None:
                held.close()  # unread data in it: the coordinator gets a reset, never a close frame
            if self._stop.is_set() or self.finished:  # nothing to come back to
                dev.state = Fate.FINISHED if self.finished else Fate.STOPPED
                return
            dev.rejoins += 1
            # A new session: nothing of the old one is still on its links or its processor.
            dev.pacer.pacing.down_free = dev.pacer.pacing.compute_free = dev.pacer.pacing.up_free = -math.inf
            log.info("%s rejoins", dev.name)

    async def _leave(self, dev: EmulatedDevice, worker: Worker, task: asyncio.Task, crash: bool) -> bool:
        """Leave gracefully, or crash (only a connected device can: else it just stops); True if it crashed."""
        ws = worker.connection
        crash = crash and ws is not None
        if crash:
            # Keep the socket open under another descriptor, then drop the connection without a
            # byte: no Leave, no close frame, no FIN. The coordinator hears silence.
            raw = ws.transport.get_extra_info("socket")
            if raw is not None:
                self._held[dev.index] = socket.socket(fileno=os.dup(raw.fileno()))
            ws.transport.abort()
            task.cancel()
            dev.leaves_crash += 1
        else:
            worker.request_stop()
            dev.leaves_graceful += 1
        await self._settle(task)
        dev.retire(worker)
        return crash

    @staticmethod
    async def _settle(task: asyncio.Task, timeout: float = 15.0) -> None:
        """Wait for a leaving worker (cancel it if it lingers); its late errors are not news."""
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            task.cancel()
            await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # retrieved

    def _ended(self, dev: EmulatedDevice, worker: Worker, task: asyncio.Task) -> None:
        dev.retire(worker)
        exc = task.exception() if not task.cancelled() else None
        if exc is None:
            if worker.stats.state == WorkerState.FINISHED:
                dev.state = Fate.FINISHED
                self._job_finished()
            else:
                dev.state = Fate.FINISHED if self.finished else Fate.STOPPED
            return
        if isinstance(exc, ClientError) and exc.exit_code == EXIT_BANNED:
            dev.state, dev.error = Fate.BANNED, str(exc)
            log.info("%s was banned: %s", dev.name, exc)
            return
        dev.state, dev.error = Fate.FAILED, str(exc)
        if isinstance(exc, ClientError):  # a wrong token or URL is every device's problem
            if self.fatal is None:
                self.fatal = exc
            self.request_stop()
            return
        raise exc

    def _job_finished(self) -> None:
        if self.finished:
            return
        self.finished = True
        assert self._over is not None
        self._over.set()  # nobody away comes back
        for dev in self.devices:  # nor does anyone trying to connect; the connected hear "finished"
            if dev.worker is not None and not dev.connected:
                dev.worker.request_stop()
        asyncio.get_running_loop().call_later(self.cfg.finish_grace, self.request_stop)

    # ---------------------------------------------------------------- reporting

    def snapshot(self) -> dict:
        """Live counters for a progress line."""
        devs = self.devices
        bad = [d for d in devs if d.byzantine]
        return {
            "devices": len(devs),
            "connected": sum(d.connected for d in devs),
            "away": sum(d.state == Fate.AWAY for d in devs),
            "tiles": sum(d.count("tiles") for d in devs),
            "rejected": sum(d.count("rejected") for d in devs),
            "bytes_down": sum(d.count("bytes_down") for d in devs),
            "bytes_up": sum(d.count("bytes_up") for d in devs),
            "forged": sum(d.forger.forged for d in bad if d.forger),
            "forged_rejected": sum(d.count("rejected") for d in bad),
            "banned": sum(d.state == Fate.BANNED for d in devs),
            "overruns": sum(d.pacer.overruns for d in devs),
            "leaves": sum(d.leaves_graceful + d.leaves_crash for d in devs),
            "crashes": sum(d.leaves_crash for d in devs),
            "rejoins": sum(d.rejoins for d in devs),
            "seconds": (self.ended or self._clock()) - self.started,
            "finished": self.finished,
        }

    def summary(self) -> dict:
        """The final report (``cleave emulate --json``)."""
        cfg = self.cfg
        classes = []
        for cls in cfg.classes:
            mine = [d for d in self.devices if d.cls == cls.name]
            if not mine:
                continue
            pacing = mine[0].pacer.pacing
            classes.append(
                {
                    "name": cls.name,
                    "devices": len(mine),
                    "byzantine": sum(d.byzantine for d in mine),
                    "gflops": pacing.flops_per_s / 1e9,
                    "down_mbps": pacing.down * 8 / 1e6,
                    "up_mbps": pacing.up * 8 / 1e6,
                    "rtt_ms": pacing.latency * 2e3,
                    "tiles": sum(d.count("tiles") for d in mine),
                    "rejected": sum(d.count("rejected") for d in mine),
                    "overruns": sum(d.pacer.overruns for d in mine),
                    "leaves": sum(d.leaves_graceful + d.leaves_crash for d in mine),
                    "rejoins": sum(d.rejoins for d in mine),
                    "banned": sum(d.state == Fate.BANNED for d in mine),
                }
            )
        snap = self.snapshot()
        return {
            "url": cfg.url,
            "devices": len(self.devices),
            "dtype": cfg.dtype,
            "speed": cfg.speed,
            "seed": cfg.seed,
            "leave_rate": cfg.leave_rate,
            "away_seconds": cfg.away_seconds,
            "byzantine_share": cfg.byzantine,
            "finished": self.finished,
            "seconds": round(snap["seconds"], 3),
            "tiles": snap["tiles"],
            "rejected": snap["rejected"],
            "overruns": snap["overruns"],
            "bytes_down": snap["bytes_down"],
            "bytes_up": snap["bytes_up"],
            "forged": snap["forged"],
            "forged_rejected": snap["forged_rejected"],
            "leaves": {"graceful": snap["leaves"] - snap["crashes"], "crash": snap["crashes"]},
            "rejoins": snap["rejoins"],
            "byzantine": [d.name for d in self.devices if d.byzantine],
            "banned": [d.name for d in self.devices if d.state == Fate.BANNED],
            "classes": classes,
            "device_list": [d.as_json() for d in self.devices],
        }
