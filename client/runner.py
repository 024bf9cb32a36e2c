"""A volunteer device's work loop: connect, pull tiles, compute, return, reconnect, and step
aside whenever the owner needs the machine.

Three tasks share one websocket: the receiver decodes ``Work`` as it arrives (caching input
blocks and queueing tiles: the coordinator keeps ``slots`` tiles in flight, so the next tile is
already here while this one computes); the computer runs each matmul in a worker thread so the
connection keeps answering; the warden polls the idle/power probe twice a second and, when the
policy says stop, pauses at once (the coordinator takes the tiles back). Every network failure
becomes a reconnect with back-off.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from client import benchmark, kernels, sysinfo
from client.connection import URLRefused, check_url, client_tls
from client.credentials import Credential as StoredCredential
from client.credentials import CredentialError, CredentialStore
from client.idle import Probe, SystemProbe
from client.policy import Decision, Policy, PolicyConfig
from coordinator.wire import auth
from coordinator.wire.codes import CloseCode, Code, ReleaseWhy
from coordinator.wire.errors import Banned, ClientError, ProtocolError, Refused
from coordinator.wire.messages import (
    Cancel,
    Challenge,
    Credential,
    Credit,
    Error,
    Finished,
    Heartbeat,
    Hello,
    Leave,
    Pause,
    Release,
    Result,
    Resume,
    Welcome,
    Work,
    decode,
    encode,
)
from coordinator.wire.verify import freivalds

log = logging.getLogger("cleave.client")

MAX_FRAME = 256 << 20  # the coordinator is trusted more than its volunteers, but not unboundedly
VERSION = "0.2.0"
MAX_NAME = 64  # the coordinator refuses longer names
CHALLENGE_TIMEOUT = 10.0  # seconds for the coordinator's first frame
DEFAULT_HEARTBEAT = 2.0  # until the coordinator's Welcome says otherwise
SILENCE_FACTOR = 15  # a coordinator silent this many heartbeats is gone (a big Work frame takes a while)

# Exit codes of ``cleave join``, from the error tree: bad options, a refused token and a revoked
# credential are usage errors (``Refused``, 2); a ban is 3. A service manager should not restart
# on either.
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_BANNED = 0, ClientError.exit_code, Refused.exit_code, Banned.exit_code
# Closes after which reconnecting cannot help.
_PERMANENT: dict[CloseCode, type[ClientError]] = {CloseCode.REVOKED: Refused, CloseCode.BANNED: Banned}

Compute = Callable[[torch.Tensor, torch.Tensor], "tuple[torch.Tensor, float]"]


class Pacer(Protocol):
    """Paces an emulated device to a profile. Times are ``time.monotonic()`` seconds."""

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
    url: str
    token: str = ""  # the join token: needed to enrol, not once a credential is stored
    name: str = field(default_factory=lambda: sysinfo.machine_name()[:MAX_NAME])
    device: str = "auto"
    threads: int | None = None
    slots: int = 2
    once: bool = False
    backoff_max: float = 30.0
    benchmark_seconds: float = 0.3
    policy: PolicyConfig = field(default_factory=PolicyConfig.always)  # the CLI applies the polite defaults
    poll_seconds: float = 0.5  # how often the idle/power probe is read: pauses land within a second
    cafile: str | None = None  # verify wss:// against this CA instead of the system's
    insecure: bool = False  # allow plain ws:// to a host other than this machine
    credentials: Path | None = None  # the credentials file (default: the user's config folder)
    new_identity: bool = False  # enrol again with the token, replacing a stored credential

    def __post_init__(self) -> None:
        try:
            check_url(self.url, insecure=self.insecure)
        except URLRefused as exc:
            raise Refused(str(exc)) from None
        if not (self.name and len(self.name) <= MAX_NAME and self.name.isprintable()):
            raise Refused(f"--name must be 1 to {MAX_NAME} printable characters, got {self.name!r}")
        if len(self.token) > 256 or not self.token.isprintable():
            raise Refused("--token must be at most 256 printable characters")
        if self.threads is not None and not (1 <= self.threads <= 1024):
            raise Refused(f"--threads must be between 1 and 1024, got {self.threads}")
        if not (1 <= self.slots <= 8):
            raise Refused(f"--slots must be between 1 and 8, got {self.slots}")
        if not (0.05 <= self.poll_seconds <= 60):
            raise Refused("the probe poll interval must be between 0.05 and 60 s")


@dataclass
class WorkerStats:
    state: str = "starting"
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
    credit_gflop: float = 0.0  # verified work of this client process, as the coordinator counts it
    credit_total_gflop: float = 0.0  # ... and of this device's identity, over every job
    identity: int | None = None
    started: float = field(default_factory=time.monotonic)
    last_error: str = ""

    @property
    def gflops(self) -> float:
        return self.flops / self.compute_seconds / 1e9 if self.compute_seconds else 0.0

    @property
    def uptime(self) -> float:
        return time.monotonic() - self.started


class Worker:
    def __init__(
        self,
        cfg: WorkerConfig,
        *,
        compute: Compute | None = None,
        probe: Probe | None = None,
        on_update: Callable[[WorkerStats], None] | None = None,
        on_decision: Callable[[Decision, object], None] | None = None,
        pacer: Pacer | None = None,
    ) -> None:
        self.cfg = cfg
        self.device = kernels.pick_device(cfg.device)
        threads = cfg.policy.max_threads or cfg.threads
        if cfg.threads and cfg.policy.max_threads:
            threads = min(cfg.threads, cfg.policy.max_threads)
        kernels.configure(self.device, threads)
        self._custom_compute = compute
        self._pacer = pacer
        self._on_update = on_update or (lambda stats: None)
        self._on_decision = on_decision or (lambda decision, reading: None)
        self.stats = WorkerStats(device=str(self.device))
        self.policy = Policy(cfg.policy)
        self.probe = probe or SystemProbe()
        self._allowed = True
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cleave-compute")
        self._stopping = False
        self._stop_event: asyncio.Event | None = None
        self._ws: ClientConnection | None = None
        self._cancelled: set[int] = set()
        self._assigned: set[int] = set()  # received and not yet answered
        self._heard = time.monotonic()
        self._credit_before = 0.0
        self._credentials = CredentialStore(cfg.credentials)
        self._coordinator: str | None = None
        self._enrolled = False  # this process enrolled an identity (--new-identity applies once)
        try:
            self._tls = client_tls(cfg.url, cfg.cafile)
        except URLRefused as exc:
            raise Refused(str(exc)) from None

    def _compute(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, float]:
        if self._custom_compute is not None:
            return self._custom_compute(a, b)
        return kernels.matmul(a, b, self.device)

    @property
    def connection(self) -> ClientConnection | None:
        """The open websocket, if any (the emulator drops it to play a crash)."""
        return self._ws

    def _set(self, state: str, error: str = "", reason: str | None = None) -> None:
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
        self._set("leaving")
        if self._stop_event is not None:
            self._stop_event.set()
        if self._ws is not None:
            asyncio.ensure_future(self._leave(self._ws))

    async def _leave(self, ws: ClientConnection) -> None:
        try:
            await ws.send(encode(Leave("user stopped the client")))
            await ws.close(1000, "leaving")
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
        self._check_device()
        if self.stats.benchmark_gflops == 0.0 and self.cfg.benchmark_seconds > 0:
            self._set("benchmarking")
            gflops, cached = await loop.run_in_executor(
                self._pool, benchmark.quick_gflops, self.device, None, self.cfg.benchmark_seconds
            )
            self.stats.benchmark_gflops, self.stats.benchmark_cached = gflops, cached
        delay = 0.5
        try:
            while not self._stopping:
                self._set("connecting")
                try:
                    async with connect(
                        self.cfg.url,
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
                        outcome = await self._session(ws)
                except InvalidURI as exc:
                    raise Refused(f"bad coordinator URL: {exc}") from None
                except ssl.SSLCertVerificationError as exc:
                    # Never retried silently: a certificate that does not verify is a wrong address,
                    # a missing --cafile, or someone in the middle.
                    raise Refused(f"the coordinator's TLS certificate does not verify: {exc.verify_message}") from None
                except (OSError, InvalidHandshake, ConnectionClosed, TimeoutError, asyncio.TimeoutError) as exc:
                    outcome = f"coordinator unavailable ({type(exc).__name__}: {exc})".strip()
                finally:
                    self._ws = None
                if outcome == "finished":
                    if self.cfg.once:
                        self._set("finished", reason="the job is complete")
                        return EXIT_OK
                    outcome = "job finished; waiting for the next one"
                if self._stopping:
                    break
                wait = delay * random.uniform(0.8, 1.2)
                self._set("reconnecting", f"{outcome}; retrying in {wait:.1f} s")
                try:
                    await asyncio.wait_for(self._stop_event.wait(), wait)
                except (TimeoutError, asyncio.TimeoutError):
                    pass
                delay = min(self.cfg.backoff_max, delay * 2)
            self._set("stopped")
            return EXIT_OK
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ one connection

    def _block_budget(self) -> int:
        cap = self.cfg.policy.max_memory_mb << 20
        return cap or benchmark.usable_memory(self.device) // 4

    def _hello(self, challenge: Challenge) -> tuple[Hello, bool]:
        """Our answer to the coordinator's challenge: a proof with the stored credential, or the
        join token to enrol. Returns (hello, enrolling)."""
        common = dict(
            name=self.cfg.name,
            platform=sysinfo.describe_platform()[:128],
            cores=min(sysinfo.cores(), 1 << 16),
            memory_bytes=min(sysinfo.memory_bytes(), 1 << 50),
            device=self.device.type,
            gflops=min(round(self.stats.benchmark_gflops, 3), 1e7),
            slots=self.cfg.slots,
            client_version=VERSION,
            block_budget=min(self._block_budget(), 1 << 50),
            paused="" if self._allowed else (self.stats.reason or "paused by its owner"),  # still paused from before
        )
        try:
            credential = (
                None
                if self.cfg.new_identity and not self._enrolled
                else self._credentials.get(challenge.coordinator, self.cfg.name, self.cfg.url)
            )
        except CredentialError as exc:
            raise Refused(str(exc)) from None
        if credential is not None:
            answer = auth.proof(credential.secret, credential.identity, bytes.fromhex(challenge.nonce))
            return Hello(identity=credential.identity, proof=answer.hex(), **common), False
        if not self.cfg.token:
            raise Refused(
                f"no credential for this coordinator under the name {self.cfg.name!r} in "
                f"{self._credentials.path}; pass --token (the join token) to enrol"
            )
        return Hello(token=self.cfg.token, **common), True

    async def _session(self, ws: ClientConnection) -> str:
        try:
            challenge = decode(await asyncio.wait_for(ws.recv(), CHALLENGE_TIMEOUT))
        except ProtocolError as exc:
            return f"the coordinator's first frame was not understood ({exc})"
        if not isinstance(challenge, Challenge) or len(challenge.nonce) != 2 * auth.NONCE_BYTES:
            return "the coordinator did not start with a challenge (an older version?)"
        self._coordinator = challenge.coordinator
        hello, enrolling = self._hello(challenge)
        await self._send(ws, encode(hello))
        queue: asyncio.Queue[tuple[Work, float]] = asyncio.Queue()  # work, when it arrived
        blocks: dict[str, torch.Tensor] = {}
        self._cancelled, self._assigned = set(), set()
        self._credit_before = self.stats.credit_gflop
        self._heard = time.monotonic()
        # Paced results wait for their upload here, so the next tile computes meanwhile.
        outbox: asyncio.Queue[tuple[float, bytes]] | None = None if self._pacer is None else asyncio.Queue()
        tasks = [
            asyncio.create_task(self._compute_loop(ws, queue, blocks, outbox)),
            asyncio.create_task(self._warden(ws)),
        ]
        if outbox is not None:
            tasks.append(asyncio.create_task(self._uplink(ws, outbox)))
        pulse = asyncio.create_task(self._heartbeat(ws, DEFAULT_HEARTBEAT))
        try:
            async for frame in ws:
                self._heard = time.monotonic()
                self.stats.bytes_down += len(frame)
                try:
                    msg = decode(frame)
                except ProtocolError as exc:
                    log.error("coordinator sent a bad frame: %s", exc)
                    continue
                if isinstance(msg, Work):
                    for namespace in msg.forget:
                        prefix = f"{namespace}."
                        for key in [k for k in blocks if k.startswith(prefix)]:
                            del blocks[key]
                    for block in msg.blocks:
                        try:
                            blocks[block.key] = kernels.to_device(block.data, self.device)
                        except RuntimeError as exc:  # the GPU is full (the owner's programs?): CPU
                            self._fall_back(f"{self.device} could not hold a block: {exc}")
                            for key in list(blocks):
                                blocks[key] = blocks[key].cpu()
                            blocks[block.key] = block.data
                    self._assigned.add(msg.tile_id)
                    arrived = time.monotonic() if self._pacer is None else self._pacer.arrived(len(frame))
                    queue.put_nowait((msg, arrived))
                elif isinstance(msg, Cancel):
                    # Another copy won: skip it, or drop its result. Cancels for tiles already answered
                    # need no memory.
                    self._cancelled.update(t for t in msg.tile_ids if t in self._assigned)
                elif isinstance(msg, Credit):
                    # Per connection on the coordinator's side; this client's total spans reconnects.
                    self.stats.credit_gflop = self._credit_before + msg.session_gflop
                    self.stats.credit_total_gflop = msg.total_gflop
                    self._on_update(self.stats)
                elif isinstance(msg, Credential):
                    self._store_credential(msg)
                elif isinstance(msg, Welcome):
                    self.stats.device_id, self.stats.job, self.stats.identity = msg.device_id, msg.job, msg.identity
                    pulse.cancel()
                    pulse = asyncio.create_task(self._heartbeat(ws, msg.heartbeat))
                    if self._allowed:
                        self._set("waiting for work", reason="")
                    else:
                        self._set("paused", reason=self.stats.reason)
                elif isinstance(msg, Finished):
                    return "finished"
                elif isinstance(msg, Error):
                    if msg.code is Code.REJECTED:
                        self.stats.rejected += 1
                    log.warning("coordinator: %s (%s)", msg.message, msg.code)
                    self._set(self.stats.state, msg.message)
        except ConnectionClosed:
            pass
        finally:
            for task in (*tasks, pulse):
                task.cancel()
            await asyncio.gather(*tasks, pulse, return_exceptions=True)
        code, reason = ws.close_code, ws.close_reason or ""
        if self._stopping:
            return "stopped"
        if code == CloseCode.AUTH:
            if enrolling:
                raise Refused(f"the coordinator refused the join token ({reason})")
            # Never dropped silently: a server that refuses it may not be the one that issued it.
            raise Refused(
                f"the coordinator refused this device's credential ({reason}); if its database "
                "was replaced, enrol again with --new-identity --token JOIN-TOKEN"
            )
        if code in _PERMANENT:
            what = "banned this device" if code == CloseCode.BANNED else "refused this device"
            raise _PERMANENT[CloseCode(code)](f"the coordinator {what}: {reason}")
        return f"connection closed ({code} {reason})".strip()

    def _store_credential(self, msg: Credential) -> None:
        self._enrolled = True
        if self._coordinator is None:
            return
        try:
            self._credentials.put(
                self._coordinator,
                self.cfg.name,
                StoredCredential(msg.identity, bytes.fromhex(msg.secret), self.cfg.url),
            )
        except CredentialError as exc:  # the session works; the next one enrols again
            log.warning("%s; this device will enrol again next time", exc)
            self.stats.last_error = str(exc)

    async def _warden(self, ws: ClientConnection) -> None:
        """Keep the owner's rules: pause the moment they say stop, resume when they allow."""
        loop = asyncio.get_running_loop()
        while True:
            reading = await loop.run_in_executor(None, self.probe.read)  # may run a subprocess
            decision = self.policy.decide(reading, time.monotonic(), dt.datetime.now().time())
            self._on_decision(decision, reading)
            if decision.run != self._allowed:
                self._allowed = decision.run
                if decision.run:
                    await self._send(ws, encode(Resume()))
                    self._set("waiting for work", reason="")
                else:
                    # Whatever we hold is the coordinator's again; results computed anyway are dropped.
                    self._cancelled |= self._assigned
                    await self._send(ws, encode(Pause(decision.reason)))
                    self._set("paused", reason=decision.reason)
            elif not decision.run and decision.reason != self.stats.reason:
                self._set("paused", reason=decision.reason)
            await asyncio.sleep(self.cfg.poll_seconds)

    async def _heartbeat(self, ws: ClientConnection, interval: float) -> None:
        """Tell the coordinator we are alive; hang up if it has gone silent (then reconnect)."""
        interval = min(max(interval, 0.1), 60.0)
        while True:
            await asyncio.sleep(interval)
            if time.monotonic() - self._heard > SILENCE_FACTOR * interval:
                log.warning("coordinator silent for %.0f s; reconnecting", time.monotonic() - self._heard)
                await ws.close(1001, "coordinator silent")
                return
            await self._send(ws, encode(Heartbeat(time.time())))

    async def _send(self, ws: ClientConnection, frame: bytes) -> None:
        await ws.send(frame)
        self.stats.bytes_up += len(frame)

    async def _uplink(self, ws: ClientConnection, outbox: asyncio.Queue[tuple[float, bytes]]) -> None:
        """Paced results, in order, each sent when its emulated upload is over."""
        while True:
            at, frame = await outbox.get()
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            await self._send(ws, frame)

    async def _compute_loop(
        self,
        ws: ClientConnection,
        queue: asyncio.Queue[tuple[Work, float]],
        blocks: dict[str, torch.Tensor],
        outbox: asyncio.Queue[tuple[float, bytes]] | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        pacer = self._pacer
        while True:
            work, arrived = await queue.get()
            started = None if pacer is None else await pacer.start(arrived)  # an emulated device's turn
            if work.tile_id in self._cancelled or not self._allowed:
                # Cancelled, or sent before the coordinator saw our pause: not ours any more.
                self._cancelled.discard(work.tile_id)
                self._assigned.discard(work.tile_id)
                continue
            try:  # pieces summed on the device are joined here: that allocates
                operands = work.operands(blocks)
            except (RuntimeError, MemoryError) as exc:
                log.error("tile %d: cannot gather its blocks (%s); releasing it", work.tile_id, exc)
                self._assigned.discard(work.tile_id)
                self._cancelled.discard(work.tile_id)
                await self._send(ws, encode(Release((work.tile_id,), ReleaseWhy.COMPUTE_FAILED, str(exc)[:200])))
                continue
            if operands is None:
                # Never sit on a tile we cannot compute: give it back so the GEMM is not stalled.
                log.error("tile %d names a block this device does not hold; releasing it", work.tile_id)
                self._assigned.discard(work.tile_id)
                self._cancelled.discard(work.tile_id)
                await self._send(ws, encode(Release((work.tile_id,), ReleaseWhy.MISSING_BLOCK)))
                continue
            a, b = operands
            flops = 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
            # The coordinator counts it as the device's, not the link's.
            waited = (time.monotonic() if started is None else started) - arrived
            self._set("working")
            try:
                try:
                    c, seconds = await loop.run_in_executor(self._pool, self._compute, a, b)
                except RuntimeError as exc:
                    if self.device.type == "cpu":
                        raise
                    # The GPU failed (out of memory, driver reset...): carry on with the CPU.
                    self._fall_back(f"{self.device} failed: {exc}")
                    for key in list(blocks):
                        blocks[key] = blocks[key].cpu()
                    a, b = a.cpu(), b.cpu()
                    c, seconds = await loop.run_in_executor(self._pool, self._compute, a, b)
            except (RuntimeError, MemoryError) as exc:
                # Never die holding a tile: give it back and carry on with the next one.
                log.error("tile %d failed on %s (%s); releasing it", work.tile_id, self.device, exc)
                self._assigned.discard(work.tile_id)
                self._cancelled.discard(work.tile_id)
                self.stats.last_error = f"tile failed: {exc}"
                await self._send(ws, encode(Release((work.tile_id,), ReleaseWhy.COMPUTE_FAILED, str(exc)[:200])))
                continue
            if pacer is not None and started is not None:
                seconds = await pacer.finish(started, flops)
            self._assigned.discard(work.tile_id)
            if work.tile_id in self._cancelled:  # cancelled (or paused) while computing: nobody wants it
                self._cancelled.discard(work.tile_id)
                continue
            frame = encode(Result(work.tile_id, c, seconds, waited))
            if pacer is None or outbox is None:
                await self._send(ws, frame)
            else:
                outbox.put_nowait((pacer.deliver_at(len(frame)), frame))
            self.stats.tiles += 1
            self.stats.flops += flops
            self.stats.compute_seconds += seconds
            if queue.empty() and self._allowed:
                self._set("waiting for work")
            else:
                self._on_update(self.stats)
