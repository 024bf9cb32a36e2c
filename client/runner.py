"""A volunteer device's I/O shell: connect, answer, compute, reconnect, and step aside whenever
the owner needs the machine.

The protocol's decisions live in ``client.session.Session`` (sans-I/O: messages and the time in,
messages and events out). This module owns what the session must not: the websocket, the clock,
the compute thread, the owner's idle/power probe and reconnects with back-off. Four tasks share
one websocket: the receiver feeds each frame to the session and acts on its events (the
coordinator keeps ``slots`` tiles in flight, so the next tile is already queued while this one
computes); the computer takes the session's tiles and runs each matmul in a worker thread so the
connection keeps answering; the warden polls the probe twice a second and tells the session when
the policy says stop or go; the heartbeat timer ticks the session. Every network failure becomes
a reconnect with back-off.

Time comes from an injected ``clock`` (monotonic seconds) and ``wall`` (Unix seconds, for the
policy's hours and the heartbeat's stamp), so tests and the emulator decide what time it is.

An optional ``Pacer`` makes the worker an emulated device (``cleave emulate``,
emulator/devices.py): it delays each tile's start, the end of its compute and the delivery of
its result to what a device of some profile would take. Without one nothing is delayed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import logging
import random
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from cleave.client import benchmark, kernels, sysinfo
from cleave.client.connection import URLRefused, check_url, client_tls
from cleave.client.credentials import Credential as StoredCredential
from cleave.client.credentials import CredentialError, CredentialStore
from cleave.client.idle import Probe, SystemProbe
from cleave.client.policy import Decision, Policy, PolicyConfig
from cleave.client.relaylink import TIMEOUT as RELAY_WAIT
from cleave.client.relaylink import RelayFailed, RelayLink
from cleave.client.session import (
    Credited,
    Ended,
    Ending,
    Enrolled,
    ErrorReceived,
    Event,
    HangUp,
    Redirected,
    Session,
    Sleeping,
    TileQueued,
    Welcomed,
    Woken,
)
from cleave.client.state import WorkerState
from cleave.meters import EnergyMeter
from cleave.wire.addresses import relay_host_refused
from cleave.wire.codes import CloseCode, RelayFault
from cleave.wire.errors import Banned, ClientError, ProtocolError, Refused
from cleave.wire.messages import (
    DEFAULT_SLOTS,
    ENERGY_EVERY,
    MAX_BYTES,
    MAX_CORES,
    MAX_GFLOPS,
    MAX_GRID,
    MAX_JOULES,
    MAX_NAME,
    MAX_PLATFORM,
    MAX_SPAN,
    MAX_TOKEN,
    Block,
    Energy,
    Hello,
    Leave,
    Message,
    RelayReport,
    Result,
    UseRelay,
    Work,
    WorkBatch,
    decode,
    encode,
)
from cleave.wire.verify import freivalds
from cleave.wire.version import package_version

log = logging.getLogger("cleave.client")

MAX_FRAME = 256 << 20  # the coordinator is trusted more than its volunteers, but not unboundedly
CHALLENGE_TIMEOUT = 10.0  # seconds for the coordinator's first frame
# Seconds a computed result may wait for the next tile's, to go out in one frame with it: far
# below any deadline, and a tile slower than this sends its result at once.
RESULT_HOLD = 0.02
MAX_REDIRECTS = 4  # redirects followed in a row without a welcome (ranks of one tier: one is enough)


VERSION = package_version()  # hello.client_version

# Exit codes of ``cleave join``, from the error tree: bad options, a refused token and a revoked
# credential are usage errors (``Refused``, 2); a ban is 3. A service manager should not restart
# on either.
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_BANNED = 0, ClientError.exit_code, Refused.exit_code, Banned.exit_code

Compute = Callable[[torch.Tensor, torch.Tensor], "tuple[torch.Tensor, float]"]
Clock = Callable[[], float]


class Pacer(Protocol):
    """Paces an emulated device to a profile. Times are seconds on the Worker's ``clock``."""

    def arrived(self, nbytes: int) -> float:
        """A work frame of ``nbytes`` arrived just now: when its blocks are usable on the device."""
        ...

    async def start(self, ready: float) -> float:
        """Wait until the tile usable at ``ready`` may start computing; returns that start."""
        ...

    async def finish(self, start: float, flops: float) -> float:
        """Its product is done: wait out the rest of its paced compute; returns the compute seconds."""
        ...

    def deliver_at(self, nbytes: int) -> float:
        """A result of ``nbytes`` is ready now: when it reaches the coordinator (sent then)."""
        ...


@dataclass(frozen=True)
class WorkerConfig:
    """What ``cleave join`` was asked to do; checked at once (``Refused`` when unusable)."""

    url: str
    token: str = ""  # the join token: needed to enrol, not once a credential is stored
    name: str = field(default_factory=lambda: sysinfo.machine_name()[:MAX_NAME])
    device: str = "auto"
    threads: int | None = None
    slots: int = DEFAULT_SLOTS
    once: bool = False
    backoff_max: float = 30.0
    benchmark_seconds: float = 0.3
    policy: PolicyConfig = field(default_factory=PolicyConfig.always)  # the CLI applies the polite defaults
    poll_seconds: float = 0.5  # how often the idle/power probe is read: pauses land within a second
    cafile: str | None = None  # verify wss:// against this CA instead of the system's
    insecure: bool = False  # allow plain ws:// to a host other than this machine
    credentials: Path | None = None  # the credentials file (default: the user's config folder)
    new_identity: bool = False  # enrol again with the token, replacing a stored credential
    grid_gco2_kwh: float = 0.0  # the owner's grid carbon intensity (0: the coordinator's)
    energy_every: float = ENERGY_EVERY  # seconds between energy reports, at the most often
    powercap: Path | None = None  # where the RAPL counters are (None: meters/'s POWERCAP)

    def __post_init__(self) -> None:
        try:
            check_url(self.url, insecure=self.insecure)
        except URLRefused as exc:
            raise Refused(str(exc)) from None
        if not (self.name and len(self.name) <= MAX_NAME and self.name.isprintable()):
            raise Refused(f"--name must be 1 to {MAX_NAME} printable characters, got {self.name!r}")
        if len(self.token) > MAX_TOKEN or not self.token.isprintable():
            raise Refused(f"--token must be at most {MAX_TOKEN} printable characters")
        if self.threads is not None and not (1 <= self.threads <= 1024):
            raise Refused(f"--threads must be between 1 and 1024, got {self.threads}")
        if not (1 <= self.slots <= 8):
            raise Refused(f"--slots must be between 1 and 8, got {self.slots}")
        if not (0.05 <= self.poll_seconds <= 60):
            raise Refused("the probe poll interval must be between 0.05 and 60 s")
        if not (0.5 <= self.energy_every <= 3600):
            raise Refused(f"the energy report interval must be between 0.5 and 3600 s, got {self.energy_every:g}")
        if not (0 <= self.grid_gco2_kwh <= MAX_GRID):
            raise Refused(f"--grid-gco2-kwh must be between 0 and {MAX_GRID:g}, got {self.grid_gco2_kwh:g}")


@dataclass
class WorkerStats:
    """What the owner sees of the worker (``on_update``); ``uptime`` is on the worker's clock."""

    state: WorkerState = WorkerState.STARTING
    reason: str = ""  # why paused, or what it waits for
    device: str = ""
    device_id: int | None = None
    job: str = ""
    benchmark_gflops: float = 0.0
    benchmark_cached: bool = False
    tiles: int = 0
    rejected: int = 0
    flops: float = 0.0
    compute_seconds: float = 0.0
    bytes_down: int = 0
    bytes_up: int = 0
    relay_mb: float = 0.0  # blocks taken from a relay, checked
    energy_j: float = 0.0  # the machine's energy while it served, as reported (meters/)
    energy_source: str = ""  # where that figure comes from: rapl, battery or estimate (+nvml)
    credit_gflop: float = 0.0  # verified work of this client process, as the coordinator counts it
    credit_total_gflop: float = 0.0  # ... and of this device's identity, over every job
    identity: int | None = None
    started: float | None = None  # on ``clock``; None: now
    last_error: str = ""
    clock: Clock = field(default=time.monotonic, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.started is None:
            self.started = self.clock()

    @property
    def gflops(self) -> float:
        return self.flops / self.compute_seconds / 1e9 if self.compute_seconds else 0.0

    @property
    def uptime(self) -> float:
        return self.clock() - (self.started or 0.0)


class Worker:
    """One volunteer client: sessions with the coordinator, one after another, until the job is
    over (``once``) or ``request_stop``. ``clock`` (monotonic seconds) and ``wall`` (Unix seconds)
    are the only time it reads; ``compute`` replaces the real matmul, ``probe`` the machine's
    idle/power readings, ``pacer`` makes it an emulated device."""

    def __init__(
        self,
        cfg: WorkerConfig,
        *,
        compute: Compute | None = None,
        probe: Probe | None = None,
        on_update: Callable[[WorkerStats], None] | None = None,
        on_decision: Callable[[Decision, object], None] | None = None,
        pacer: Pacer | None = None,
        clock: Clock = time.monotonic,
        wall: Clock = time.time,
        meter: EnergyMeter | None = None,
    ) -> None:
        self.cfg = cfg
        self._clock, self._wall = clock, wall
        self.device = kernels.pick_device(cfg.device)
        threads = cfg.policy.max_threads or cfg.threads
        if cfg.threads and cfg.policy.max_threads:
            threads = min(cfg.threads, cfg.policy.max_threads)
        kernels.configure(self.device, threads)
        self._custom_compute = compute
        self._pacer = pacer
        self._on_update = on_update or (lambda stats: None)
        self._on_decision = on_decision or (lambda decision, reading: None)
        self.stats = WorkerStats(device=str(self.device), clock=clock)
        self.policy = Policy(cfg.policy)
        self.probe = probe or SystemProbe()
        self._allowed = True
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cleave-compute")
        self._stopping = False
        self._stop_event: asyncio.Event | None = None
        self._ws: ClientConnection | None = None
        self._session: Session | None = None  # the open connection's protocol state
        self._credentials = CredentialStore(cfg.credentials)
        self._enrolled = False  # this process enrolled an identity (--new-identity applies once)
        try:
            self._tls = client_tls(cfg.url, cfg.cafile)
        except URLRefused as exc:
            raise Refused(str(exc)) from None
        # Where it connects now: the configured URL, or the rank of a tier a redirect sent it to
        # (with the ticket it enrols there with, until that rank welcomes it).
        self.url = cfg.url
        self._ticket = ""
        self._redirects = 0  # redirects followed since the last welcome
        self._relay: RelayLink | None = None  # where work.fetch's blocks come from (use_relay)
        self._welcomed_here = False  # a coordinator at ``url`` has welcomed this device
        # The machine's energy while it serves. Emulated devices share one process: each counts
        # its own compute seconds on one core, not the process's CPU time.
        gpu = self.device.type if self.device.type in ("cuda", "mps") else ""
        self._meter = meter or EnergyMeter(
            gpu=gpu,
            gpu_index=self.device.index or 0,
            gpu_seconds=(lambda: self.stats.compute_seconds) if gpu else None,  # for the estimate, without NVML
            clock=clock,
            estimate_only=pacer is not None,
            **({} if cfg.powercap is None else {"powercap": cfg.powercap}),
            **({} if pacer is None else {"cpu_seconds": lambda: self.stats.compute_seconds}),
        )
        self._energy_at = clock()  # when the span now metered began
        self._standby_reason = ""  # why the coordinator sent it to standby, as its owner sees it
        self._metering = False  # welcomed on the open connection: its energy is reported there

    def _compute(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, float]:
        if self._custom_compute is not None:
            return self._custom_compute(a, b)
        return kernels.matmul(a, b, self.device)

    @property
    def connection(self) -> ClientConnection | None:
        """The open websocket, if any (the emulator drops it to play a crash)."""
        return self._ws

    def _set(self, state: WorkerState, error: str = "", reason: str | None = None) -> None:
        self.stats.state = state
        if reason is not None:
            self.stats.reason = reason
        if error:
            self.stats.last_error = error
        self._on_update(self.stats)

    # ------------------------------------------------------------------ lifecycle

    def request_stop(self) -> None:
        """Leave gracefully: tell the coordinator (its tiles are re-queued at once), then close."""
        if self._stopping:
            return
        self._stopping = True
        self._set(WorkerState.LEAVING)
        if self._stop_event is not None:
            self._stop_event.set()
        if self._ws is not None:
            asyncio.ensure_future(self._leave(self._ws))

    async def _leave(self, ws: ClientConnection) -> None:
        try:
            if self._allowed and self._metering:
                await ws.send(encode(self._energy()))
            await ws.send(encode(Leave("user stopped the client")))
            await ws.close(CloseCode.FINISHED, "leaving")  # 1000, a normal closure
        except ConnectionClosed:
            pass

    def _check_device(self) -> None:
        """A GPU must compute what the CPU computes; one that does not is not used."""
        if self.device.type == "cpu" or self._custom_compute is not None:
            return
        try:
            a, b = torch.randn(256, 256), torch.randn(256, 256)
            c, _ = kernels.matmul(kernels.to_device(a, self.device), kernels.to_device(b, self.device), self.device)
            verdict = freivalds(a, b, c.cpu(), np.random.default_rng())
            if not verdict.ok:
                raise RuntimeError(verdict.reason)
        except RuntimeError as exc:
            self._fall_back(f"self-check on {self.device} failed ({exc})")

    def _fall_back(self, why: str) -> None:
        log.warning("%s; computing on the CPU instead", why)
        self.device = torch.device("cpu")
        self.stats.device = "cpu (fallback)"
        self.stats.last_error = why

    async def run(self) -> int:
        """Work until the job finishes (with ``once``) or ``request_stop``; returns an exit code."""
        self._stop_event = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._meter.keep_reading()  # RAPL counters wrap: read between reports too
        self._check_device()
        if self.stats.benchmark_gflops == 0.0 and self.cfg.benchmark_seconds > 0:
            self._set(WorkerState.BENCHMARKING)
            gflops, cached = await loop.run_in_executor(
                self._pool, benchmark.quick_gflops, self.device, None, self.cfg.benchmark_seconds
            )
            self.stats.benchmark_gflops, self.stats.benchmark_cached = gflops, cached
        delay = 0.5
        try:
            while not self._stopping:
                self._set(WorkerState.CONNECTING)
                try:
                    async with connect(
                        self.url,
                        compression=None,
                        max_size=MAX_FRAME,
                        open_timeout=10,
                        ping_interval=20,
                        ping_timeout=120,
                        proxy=None,
                        ssl=self._tls,
                    ) as ws:
                        self._ws = ws
                        delay = 0.5
                        if self._stopping:  # Ctrl-C arrived during the handshake
                            await self._leave(ws)
                            break
                        outcome = await self._run_session(ws)
                except InvalidURI as exc:
                    raise Refused(f"bad coordinator URL: {exc}") from None
                except Refused as exc:
                    if self.url == self.cfg.url:
                        raise
                    outcome = self._back_home(str(exc))  # where it was sent refused it: start over
                except ssl.SSLCertVerificationError as exc:
                    # Never retried silently: a certificate that does not verify is a wrong address,
                    # a missing --cafile, or someone in the middle. (At a rank a redirect named:
                    # back to the URL its owner gave, saying so.)
                    why = f"the coordinator's TLS certificate does not verify: {exc.verify_message}"
                    if self.url == self.cfg.url:
                        raise Refused(why) from None
                    outcome = self._back_home(f"{why} (at {self.url})")
                except (OSError, InvalidHandshake, ConnectionClosed, TimeoutError, asyncio.TimeoutError) as exc:
                    outcome = f"coordinator unavailable ({type(exc).__name__}: {exc})".strip()
                    if self.url != self.cfg.url and not self._welcomed_here:
                        outcome = self._back_home(outcome)  # the rank it was sent to is not there
                finally:
                    self._ws = None
                if outcome == Ending.FINISHED:
                    if self.cfg.once:
                        self._set(WorkerState.FINISHED, reason="the job is complete")
                        return EXIT_OK
                    outcome = "job finished; waiting for the next one"
                if self._stopping:
                    break
                if outcome == Ending.REDIRECTED:  # another rank of the tier: go there now
                    continue
                wait = delay * random.uniform(0.8, 1.2)
                self._set(WorkerState.RECONNECTING, f"{outcome}; retrying in {wait:.1f} s")
                try:
                    await asyncio.wait_for(self._stop_event.wait(), wait)
                except (TimeoutError, asyncio.TimeoutError):
                    pass
                delay = min(self.cfg.backoff_max, delay * 2)
            self._set(WorkerState.STOPPED)
            return EXIT_OK
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ one connection

    def _block_budget(self) -> int:
        cap = self.cfg.policy.max_memory_mb << 20
        return cap or benchmark.usable_memory(self.device) // 4

    def _hello(self) -> Hello:
        """What this device says of itself; the session adds its credentials (or the token)."""
        return Hello(
            name=self.cfg.name,
            platform=sysinfo.describe_platform()[:MAX_PLATFORM],
            cores=min(sysinfo.cores(), MAX_CORES),
            memory_bytes=min(sysinfo.memory_bytes(), MAX_BYTES),
            device=self.device.type,
            gflops=min(round(self.stats.benchmark_gflops, 3), MAX_GFLOPS),
            slots=self.cfg.slots,
            batch=self.cfg.slots,  # all it may hold in one frame: fewer frames, one header for many tiles
            client_version=VERSION,
            block_budget=min(self._block_budget(), MAX_BYTES),
        )

    def _stored_credential(self, coordinator: str) -> StoredCredential | None:
        """The credential to prove, if any (``--new-identity`` enrols anew once per process)."""
        if self.cfg.new_identity and not self._enrolled:
            return None
        try:
            return self._credentials.get(coordinator, self.cfg.name, self.url)
        except CredentialError as exc:
            raise Refused(str(exc)) from None

    def _place(self, block: torch.Tensor) -> torch.Tensor:
        """Keep a cached block on the compute device; a GPU that cannot hold it means the CPU."""
        try:
            return kernels.to_device(block, self.device)
        except RuntimeError as exc:  # the GPU is full (the owner's programs?): CPU
            self._fall_back(f"{self.device} could not hold a block: {exc}")
            self._blocks_to_cpu()
            return block

    def _blocks_to_cpu(self) -> None:
        if self._session is not None:
            blocks = self._session.blocks
            for key in list(blocks):
                blocks[key] = blocks[key].cpu()

    async def _run_session(self, ws: ClientConnection) -> str:
        """Run one connection to its end; returns why it ended (raises when retrying cannot help)."""
        session = Session(
            self._hello(),
            now=self._clock(),
            token=self.cfg.token if self.url == self.cfg.url else "",  # never one rank's token to another
            ticket=self._ticket,
            credential=self._stored_credential,
            credentials_file=str(self._credentials.path),
            paused="" if self._allowed else (self.stats.reason or "paused by its owner"),  # still paused from before
            credit_before=self.stats.credit_gflop,
            place=self._place,
            arrival=None if self._pacer is None else self._pacer.arrived,
        )
        self._session = session
        try:
            return await self._converse(ws, session)
        finally:
            self._session = None

    async def _converse(self, ws: ClientConnection, session: Session) -> str:
        first = await asyncio.wait_for(ws.recv(), CHALLENGE_TIMEOUT)
        for event in session.receive_frame(first, self._clock()):
            if isinstance(event, Ended):
                return event.outcome
            if isinstance(event, Redirected):  # not a first message: ignored by the session
                return self._follow(event)
        await self._flush(ws, session)  # the hello
        work = asyncio.Event()  # set when tiles are queued
        # Paced results wait for their upload here, so the next tile computes meanwhile.
        outbox: asyncio.Queue[tuple[float, bytes]] | None = None if self._pacer is None else asyncio.Queue()
        tasks = [
            asyncio.create_task(self._compute_loop(ws, session, work, outbox)),
            asyncio.create_task(self._warden(ws, session)),
        ]
        if outbox is not None:
            tasks.append(asyncio.create_task(self._uplink(ws, outbox)))
        # Frames are read as they come, each with its arrival time: a work frame that waits here
        # behind another's relay fetch has its blocks due by its own arrival + fetch_wait, so
        # relay waits never add up past a lease's share (what piles up here meanwhile is what the
        # coordinator sends in one fetch_wait: work for the slots it grants, and control frames).
        inbox: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        reader = asyncio.create_task(self._read(ws, inbox))
        tasks.append(reader)
        pulse = asyncio.create_task(self._heartbeat(ws, session))
        try:
            while (item := await inbox.get()) is not None:
                arrived, frame = item
                self.stats.bytes_down += len(frame)
                for event in await self._receive(ws, session, frame, arrived):
                    if isinstance(event, TileQueued):
                        work.set()
                    elif isinstance(event, Credited):
                        self.stats.credit_gflop, self.stats.credit_total_gflop = event.gflop, event.total_gflop
                        self._on_update(self.stats)
                    elif isinstance(event, Enrolled):
                        self._store_credential(event)
                    elif isinstance(event, Welcomed):
                        self._meter.restart()  # its first report covers the time since its welcome
                        self._energy_at = self._clock()
                        self._metering = True
                        self._ticket, self._redirects = "", 0  # spent: it has a credential here now
                        self._welcomed_here = True
                        self.stats.device_id, self.stats.job = event.device_id, event.job
                        self.stats.identity = event.identity
                        pulse.cancel()  # the interval changed: the next beat is one new interval away
                        pulse = asyncio.create_task(self._heartbeat(ws, session))
                        if self._allowed:
                            self._set(WorkerState.WAITING, reason="")
                        else:
                            self._set(WorkerState.PAUSED, reason=self.stats.reason)
                    elif isinstance(event, Sleeping):
                        self._sleep(event)
                    elif isinstance(event, Woken):
                        pulse.cancel()  # its answer is due now, not at the keep-alive's next beat
                        pulse = asyncio.create_task(self._heartbeat(ws, session))
                        log.info("woken by the coordinator")
                        if self._allowed:
                            self._set(WorkerState.WAITING, reason="")
                    elif isinstance(event, Ended):
                        return event.outcome
                    elif isinstance(event, Redirected):
                        return self._follow(event)
                    elif isinstance(event, ErrorReceived):
                        if event.rejected:
                            self.stats.rejected += 1
                        log.warning("coordinator: %s (%s)", event.message, event.code)
                        self._set(self.stats.state, event.message)
            if reader.done() and not reader.cancelled() and (failed := reader.exception()) is not None:  # a bug, said
                raise failed
        except ConnectionClosed:
            pass
        finally:
            self._metering = False
            for task in (*tasks, pulse):
                task.cancel()
            await asyncio.gather(*tasks, pulse, return_exceptions=True)
            if self._relay is not None:  # a new session hears use_relay again
                await self._relay.close()
                self._relay = None
        if self._stopping:
            return Ending.STOPPED
        return session.closed(ws.close_code, ws.close_reason or "")

    async def _read(self, ws: ClientConnection, inbox: asyncio.Queue[tuple[float, bytes] | None]) -> None:
        """Every frame from the coordinator, as it arrives, with its arrival time; then None."""
        try:
            async for frame in ws:
                inbox.put_nowait((self._clock(), frame))
        except ConnectionClosed:
            pass
        finally:
            inbox.put_nowait(None)

    async def _receive(self, ws: ClientConnection, session: Session, frame: bytes, arrived: float) -> list[Event]:
        """A frame from the coordinator, arrived at ``arrived``: relays handled here
        (``use_relay``, and the blocks a work names by digest, taken from the relay and checked
        before the session sees them)."""
        try:
            msg = decode(frame)
        except ProtocolError:
            return session.receive_frame(frame, self._clock())  # it says what was wrong
        if isinstance(msg, UseRelay):
            if self._relay is not None:
                await self._relay.close()
            self._relay = None
            if msg.relay:
                try:
                    check_url(msg.url, insecure=self.cfg.insecure)
                    if self.url.startswith("wss://") and not msg.url.startswith("wss://"):
                        raise URLRefused(f"refusing relay {msg.url}: the coordinator is wss://, it would drop TLS")
                    if why := relay_host_refused(msg.url, self.url):  # its own machine or LAN
                        raise URLRefused(why)
                    tls = client_tls(msg.url, self.cfg.cafile)
                except URLRefused as exc:  # not a relay it would reach: its blocks come from the coordinator
                    await self._report(ws, RelayReport(msg.relay, RelayFault.UNREACHABLE), str(exc))
                    return []
                wait = msg.wait or RELAY_WAIT  # its coordinator's share of the leases' deadlines
                self._relay = RelayLink(msg.relay, msg.url, msg.ticket, self.stats.device_id or 0, tls, wait)
            return []
        works = msg.works if isinstance(msg, WorkBatch) else (msg,) if isinstance(msg, Work) else ()
        if any(w.fetch for w in works):
            msg = await self._fetched(ws, msg, works, arrived)
        return session.receive(msg, self._clock(), len(frame))

    async def _fetched(
        self, ws: ClientConnection, msg: Work | WorkBatch, works: tuple[Work, ...], arrived: float
    ) -> Work | WorkBatch:
        """``msg`` with the blocks its works fetch from the relay carried in it, each checked
        against its digest; unchanged (the session gives those tiles back) when the relay failed,
        or did not send them within the frame's wait of its arrival (``arrived``)."""
        relay = self._relay
        wanted = list(dict.fromkeys(d for w in works for _, d in w.fetch))
        if relay is None:
            return msg
        # The frame's first lease bounds the wait, counted from the frame's arrival (not from
        # now: it may have waited behind an earlier frame's fetch): its relay is reported before
        # that lease is late.
        waits = [w.fetch_wait for w in works if w.fetch and w.fetch_wait > 0]
        wait = min(waits) if waits else relay.wait
        try:
            got = await relay.fetch(wanted, wait, arrived + wait - self._clock())
        except RelayFailed as exc:
            self._relay = None
            # Reported first: its leases' deadlines run while it closes the relay's connection.
            await self._report(ws, RelayReport(relay.relay, exc.fault, exc.digest, exc.tag, exc.got), str(exc))
            await relay.close()  # a relay that lacked a block keeps no connection either
            return msg
        self.stats.relay_mb += sum(t.numel() * t.element_size() for t in got.values()) / 1e6

        def filled(w: Work) -> Work:
            extra = tuple(Block(key, got[digest]) for key, digest in w.fetch)
            return replace(w, blocks=w.blocks + extra, fetch=())

        return WorkBatch(tuple(filled(w) for w in works)) if isinstance(msg, WorkBatch) else filled(works[0])

    async def _report(self, ws: ClientConnection, report: RelayReport, why: str) -> None:
        log.warning("%s; taking blocks from the coordinator", why)
        self.stats.last_error = why
        try:
            await ws.send(encode(report))
        except ConnectionClosed:
            pass

    def _follow(self, event: Redirected) -> str:
        """A rank of the tier sent this newcomer to another rank: connect there next, with the
        ticket. Refused (the client stops, saying why) for a URL it would not take from its user,
        for a step down from wss:// to ws://, and after ``MAX_REDIRECTS`` without a welcome (ranks
        sending it round in circles)."""
        self._redirects += 1
        if self._redirects > MAX_REDIRECTS:
            raise Refused(f"redirected {MAX_REDIRECTS} times without being welcomed (last to {event.url})")
        try:
            check_url(event.url, insecure=self.cfg.insecure)
            if self.url.startswith("wss://") and not event.url.startswith("wss://"):
                raise URLRefused(f"refusing a redirect from wss:// to {event.url}: it would drop TLS")
            tls = client_tls(event.url, self.cfg.cafile)
        except URLRefused as exc:
            raise Refused(f"the coordinator redirected this device to rank {event.rank}: {exc}") from None
        log.info("redirected to rank %d at %s: %s", event.rank, event.url, event.reason)
        self.url, self._tls, self._ticket, self._welcomed_here = event.url, tls, event.ticket, False
        self._set(self.stats.state, reason=f"redirected to rank {event.rank}: {event.reason}")
        return Ending.REDIRECTED

    def _back_home(self, why: str) -> str:
        """Where a redirect sent it did not work out (unreachable before it was welcomed, or it
        refused the ticket or has no credential for it): back to the URL its owner gave, with the
        join token, after the usual back-off."""
        log.warning("%s; back to %s", why, self.cfg.url)
        self.url, self._ticket, self._welcomed_here = self.cfg.url, "", False
        # Not a circle of ranks: a rank it could not reach. It starts over at home, which stops
        # sending newcomers to a rank that never admits them (balance.UNREDEEMED).
        self._redirects = 0
        self._tls = client_tls(self.cfg.url, self.cfg.cafile)
        return f"{why}; back to {self.cfg.url}"

    def _store_credential(self, event: Enrolled) -> None:
        self._enrolled = True
        try:
            self._credentials.put(
                event.coordinator, self.cfg.name, StoredCredential(event.identity, event.secret, self.url)
            )
        except CredentialError as exc:  # the session works; the next one enrols again
            log.warning("%s; this device will enrol again next time", exc)
            self.stats.last_error = str(exc)

    async def _warden(self, ws: ClientConnection, session: Session) -> None:
        """Keep the owner's rules: pause the moment they say stop, resume when they allow."""
        loop = asyncio.get_running_loop()
        while True:
            reading = await loop.run_in_executor(None, self.probe.read)  # may run a subprocess
            time_of_day = dt.datetime.fromtimestamp(self._wall()).time()  # local, for --hours
            decision = self.policy.decide(reading, self._clock(), time_of_day)
            self._on_decision(decision, reading)
            if decision.run != self._allowed:
                self._allowed = decision.run
                if decision.run:
                    self._meter.restart()  # the paused time was its owner's
                    self._energy_at = self._clock()
                    session.resume()
                    await self._flush(ws, session)
                    if session.keepalive is not None:  # still in the coordinator's standby
                        self._set(WorkerState.STANDBY, reason=self._standby_reason)
                    else:
                        self._set(WorkerState.WAITING, reason="")
                else:
                    if self._metering:  # what it used up to now, then pause
                        await self._send(ws, encode(self._energy()))
                    session.pause(decision.reason)
                    await self._flush(ws, session)
                    self._set(WorkerState.PAUSED, reason=decision.reason)
            elif not decision.run and decision.reason != self.stats.reason:
                self._set(WorkerState.PAUSED, reason=decision.reason)
            await asyncio.sleep(self.cfg.poll_seconds)

    def _sleep(self, event: Sleeping) -> None:
        """The coordinator has no work for this device: the session dropped its blocks and tiles;
        the memory they held goes back to the machine (a GPU's cache too)."""
        kernels.release_memory(self.device)
        self._standby_reason = f"no work for now ({event.reason}); a heartbeat every {event.keepalive:g} s"
        log.info("standby: %s", self._standby_reason)
        if self._allowed:  # a pause its owner asked for shows first
            self._set(WorkerState.STANDBY, reason=self._standby_reason)

    async def _heartbeat(self, ws: ClientConnection, session: Session) -> None:
        """Tell the coordinator we are alive; hang up if it has gone silent (then reconnect)."""
        while True:
            await asyncio.sleep(max(0.0, session.next_beat - self._clock()))
            for event in session.tick(self._clock(), self._wall()):
                if isinstance(event, HangUp):
                    log.warning("coordinator silent for %.0f s; reconnecting", event.silent)
                    await ws.close(event.code, event.reason)
                    return
            await self._flush(ws, session)

    async def _flush(self, ws: ClientConnection, session: Session) -> None:
        for msg in session.messages_to_send():
            await self._send(ws, encode(msg))

    async def _send(self, ws: ClientConnection, frame: bytes) -> None:
        await ws.send(frame)
        self.stats.bytes_up += len(frame)

    async def _uplink(self, ws: ClientConnection, outbox: asyncio.Queue[tuple[float, bytes]]) -> None:
        """Paced results, in order, each sent when its emulated upload is over."""
        while True:
            at, frame = await outbox.get()
            await asyncio.sleep(max(0.0, at - self._clock()))
            await self._send(ws, frame)

    async def _send_results(
        self,
        ws: ClientConnection,
        session: Session,
        pending: list[Result],
        outbox: asyncio.Queue[tuple[float, bytes]] | None,
    ) -> None:
        """Send the results held (emptying ``pending``), as few frames as the session allows."""
        messages: list[Message] = [*session.frames_of(pending)]
        pending.clear()
        # Energy goes with results, batched (at most one report every energy_every s), never per tile.
        if self._metering and self._clock() - self._energy_at >= self.cfg.energy_every:
            messages.append(self._energy())
        for msg in messages:
            frame = encode(msg)
            if outbox is None or self._pacer is None:
                await self._send(ws, frame)
            else:
                outbox.put_nowait((self._pacer.deliver_at(len(frame)), frame))

    def _energy(self) -> Energy:
        """The machine's energy since the last report (or the welcome, or a resume)."""
        span = self._meter.span()
        self._energy_at = self._clock()
        self.stats.energy_j += span.total
        self.stats.energy_source = span.source.value + ("+nvml" if span.gpu_joules else "")
        return Energy(
            joules=min(span.joules, MAX_JOULES),
            seconds=min(span.seconds, MAX_SPAN),
            source=span.source,
            gpu_joules=min(span.gpu_joules, MAX_JOULES),
            grid_gco2_kwh=self.cfg.grid_gco2_kwh,
        )

    async def _compute_loop(
        self,
        ws: ClientConnection,
        session: Session,
        work: asyncio.Event,
        outbox: asyncio.Queue[tuple[float, bytes]] | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        pacer = self._pacer
        # Results computed and not yet sent: held while the next tile is queued and would be done
        # within RESULT_HOLD, then sent together (``session.frames_of``). A timer sends them
        # RESULT_HOLD after the first was held whatever the next tile does (it may stall).
        pending: list[Result] = []
        held_since = 0.0
        timer: asyncio.Task[None] | None = None

        async def send_held(after: float) -> None:
            await asyncio.sleep(after)
            try:
                await self._send_results(ws, session, pending, outbox)
            except ConnectionClosed:  # the session is ending: the results go with it
                pass

        try:
            while True:
                queued = session.pop()
                if queued is None:
                    await self._send_results(ws, session, pending, outbox)
                    work.clear()
                    await work.wait()
                    continue
                # An emulated device's turn, paced; a real one's is now.
                started = self._clock() if pacer is None else await pacer.start(queued.ready)
                tile = session.start(queued, started)
                if tile is None:
                    await self._flush(ws, session)  # a release, if its blocks were missing
                    continue
                self._set(WorkerState.WORKING)
                try:
                    try:
                        c, seconds = await loop.run_in_executor(self._pool, self._compute, tile.a, tile.b)
                    except RuntimeError as exc:
                        if self.device.type == "cpu":
                            raise
                        # The GPU failed (out of memory, driver reset...): carry on with the CPU.
                        self._fall_back(f"{self.device} failed: {exc}")
                        self._blocks_to_cpu()
                        c, seconds = await loop.run_in_executor(self._pool, self._compute, tile.a.cpu(), tile.b.cpu())
                except (RuntimeError, MemoryError) as exc:
                    # Never die holding a tile: give it back and carry on with the next one.
                    log.error("tile %d failed on %s (%s); releasing it", tile.tile_id, self.device, exc)
                    self.stats.last_error = f"tile failed: {exc}"
                    session.failed(tile.tile_id, str(exc))
                    await self._flush(ws, session)
                    continue
                if pacer is not None:
                    seconds = await pacer.finish(started, tile.flops)
                result = session.computed(tile, c, seconds)
                if result is None:  # cancelled (or paused) while computing: nobody wants it
                    if session.keepalive is not None:  # a standby cancelled it: its memory goes back too
                        del c, tile
                        kernels.release_memory(self.device)
                    continue
                if not pending:
                    held_since = self._clock()
                pending.append(result)
                # Held only while another tile waits and this one's pace says it will be done soon.
                if (
                    len(pending) >= session.batch
                    or not session.queued
                    or self._clock() - held_since + seconds > RESULT_HOLD
                ):
                    await self._send_results(ws, session, pending, outbox)
                elif timer is None or timer.done():
                    timer = asyncio.create_task(send_held(max(0.0, held_since + RESULT_HOLD - self._clock())))
                self.stats.tiles += 1
                self.stats.flops += tile.flops
                self.stats.compute_seconds += seconds
                if not session.queued and self._allowed:
                    self._set(WorkerState.WAITING)
                else:
                    self._on_update(self.stats)
        finally:
            if timer is not None:
                timer.cancel()
