"""The coordinator's brain, free of any network: messages and ``now`` in, messages out.

The websocket server (coordinator/server.py) decodes frames, calls these methods and sends what
they return, and calls ``tick(now)`` a few times a second; a simulator can drive the very same
object with a virtual clock.

Flow of one GEMM: ``submit`` plans its tiles and queues them in the store; ``_dispatch`` leases
queued tiles to devices with free slots (preferring tiles whose input blocks the device already
holds) and emits ``Work`` messages carrying only the blocks that device lacks; ``handle(Result)``
verifies the C block with Freivalds' check before it is kept; once every tile is verified the
GEMM is assembled and ``on_done`` receives ``A @ B``.

Faults cost only outstanding tiles:

* a device that closes its socket, leaves, or stays silent past the heartbeat timeout loses
  its leases at once, and their tiles go straight to other devices;
* every lease has a deadline (a few times the device's expected time, plus a floor); when it
  passes, a copy of the tile goes to another device while the first keeps working;
* when the queue is empty, idle devices take speculative copies of the oldest outstanding
  tiles; the first verified result wins and the other copies are cancelled;
* a late result for a tile that is finished or no longer leased to its sender is ignored.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from coordinator.blocks import BlockRef, Source, Sources, block_ref
from coordinator.protocol import (
    CLOSE_BANNED, CLOSE_SILENT, Block, Cancel, Credit, Error, Finished, Heartbeat, Hello, Leave, Message, Pause, Release, Result, Resume,
    StatusReply, StatusRequest, Welcome, Work,
)
from coordinator.tiles import GemmKind, Tile, TilePlan, TilingPolicy, a_block, assemble, b_block, plan_gemm
from coordinator.verify import freivalds
from db.store import DEADLINE, SPECULATIVE, DeviceInfo, NewTile, Store


MAX_SLOTS = 8
SHUTDOWN = "coordinator stopped"
MISSING_BLOCK = "missing input block"  # the Release reason that asks for the blocks again
CREDIT_INTERVAL = 1.0  # seconds between Credit messages to a device whose verified total grew
EMA = 0.2  # weight of a new observation in a device's running estimates


@dataclass(frozen=True)
class Send:
    device: int
    message: Message


@dataclass(frozen=True)
class Close:
    device: int
    code: int
    reason: str


Outbound = Send | Close


class AuthError(Exception):
    pass


@dataclass(frozen=True)
class FaultPolicy:
    """How long the coordinator waits before it stops trusting a device or a lease."""

    heartbeat: float = 2.0  # seconds between heartbeats each way
    # A device silent this long is presumed frozen. Generous: a heartbeat queues behind a whole
    # result frame, and a 16 MB dW partial takes ~15 s on a 1 MB/s home uplink. Frozen devices
    # cost little meanwhile: their tiles are copied as soon as their deadlines pass.
    heartbeat_timeout: float = 30.0
    lease_floor: float = 2.0  # every lease deadline is at least this long
    lease_factor: float = 4.0  # ... and this many times the device's expected time for the tile
    speculate_after: float = 0.05  # a tile out this long, and 2x what an idle device would need,
    speculate_factor: float = 2.0  # ... may be copied to that idle device
    max_copies: int = 2  # open leases of one tile: the original and one copy

    def __post_init__(self) -> None:
        if not (0 < self.heartbeat < self.heartbeat_timeout):
            raise ValueError("need 0 < heartbeat < heartbeat timeout")
        if self.lease_floor <= 0 or self.lease_factor < 1 or self.max_copies < 1:
            raise ValueError("lease floor must be positive, lease factor >= 1, max copies >= 1")


@dataclass
class GemmState:
    id: int
    kind: GemmKind
    a: torch.Tensor
    b: torch.Tensor
    plan: TilePlan
    tiles: dict[int, Tile]  # tile id -> tile
    on_done: Callable[[torch.Tensor], None]
    sources: tuple[Source, Source]
    a_blocks: dict[tuple[int, int], BlockRef]  # (i, p) -> A[rows i, ks p]
    b_blocks: dict[tuple[int, int], BlockRef]  # (p, j) -> B[ks p, cols j]
    parts: dict[int, torch.Tensor] = field(default_factory=dict)  # tile index -> verified C block

    def blocks_of(self, tile: Tile) -> tuple[BlockRef, BlockRef]:
        return self.a_blocks[(tile.i, tile.p)], self.b_blocks[(tile.p, tile.j)]

    @property
    def done(self) -> bool:
        return len(self.parts) == len(self.tiles)


@dataclass
class DeviceState:
    id: int
    name: str
    slots: int
    gflops: float  # benchmark at join, then a running estimate from verified tiles
    device: str
    last_seen: float
    seconds_per_gflop: float  # running estimate of a lease's turnaround (transfer, queue, compute)
    inflight: dict[int, float] = field(default_factory=dict)  # tile id -> leased at
    cancelled: dict[int, None] = field(default_factory=dict)  # recent cancelled tiles (ordered set)
    blocks: set[str] = field(default_factory=set)  # keys of the blocks the device holds
    namespaces: dict[int, dict[str, int]] = field(default_factory=dict)  # source id -> {key: bytes} held
    forget: set[int] = field(default_factory=set)  # namespaces to drop, sent with the next Work
    bytes_down: int = 0
    bytes_up: int = 0
    tiles_done: int = 0
    tiles_rejected: int = 0
    consecutive_rejects: int = 0
    compute_seconds: float = 0.0  # as reported by the device, verified tiles only
    last_sent: float = 0.0
    paused: str | None = None  # the owner's reason, while the device must not get work
    budget: int = 0  # bytes of cached blocks the device accepts (0: no limit)
    cached_bytes: int = 0
    gflop_verified: float = 0.0
    credit_sent: float = 0.0
    credit_at: float = 0.0

    @property
    def free(self) -> int:
        if self.paused is not None:
            return 0
        if self.budget and self.cached_bytes >= self.budget and self.inflight:
            return 0  # over its memory budget: finish what it has first (never starve it though)
        return self.slots - len(self.inflight)

    def cancel(self, tile_id: int) -> None:
        """Its copy lost the race: a late result is expected and ignored. Bounded, since a client
        that drops a cancelled tile before computing it never answers."""
        self.inflight.pop(tile_id, None)
        self.cancelled[tile_id] = None
        if len(self.cancelled) > 1024:
            del self.cancelled[next(iter(self.cancelled))]

    def expected(self, flops: int) -> float:
        return flops / 1e9 * self.seconds_per_gflop

    def hold(self, ref: BlockRef) -> None:
        self.blocks.add(ref.key)
        self.namespaces.setdefault(ref.namespace, {})[ref.key] = ref.nbytes
        self.cached_bytes += ref.nbytes

    def drop(self, namespace: int) -> None:
        keys = self.namespaces.pop(namespace, None)
        if keys is not None:
            self.blocks -= keys.keys()
            self.cached_bytes -= sum(keys.values())
            self.forget.add(namespace)

    def lose(self, ref: BlockRef) -> None:
        self.blocks.discard(ref.key)
        held = self.namespaces.get(ref.namespace, {})
        if ref.key in held:
            self.cached_bytes -= held.pop(ref.key)


@dataclass
class Progress:
    step: int = 0  # last finished step
    current: int = 0  # step whose GEMMs are being submitted
    steps: int = 0
    loss: float | None = None
    tokens_per_s: float = 0.0
    state: str = "starting"


class Core:
    def __init__(
        self,
        store: Store,
        job_id: int,
        *,
        token: str,
        rng: np.random.Generator,
        policy: TilingPolicy | None = None,
        faults: FaultPolicy | None = None,
        max_consecutive_rejects: int = 3,
        job_name: str = "",
    ) -> None:
        self.store = store
        self.job_id = job_id
        self.token = token
        self.rng = rng
        self.policy = policy or TilingPolicy()
        self.faults = faults or FaultPolicy()
        self.max_consecutive_rejects = max_consecutive_rejects
        self.job_name = job_name or f"job {job_id}"
        self.devices: dict[int, DeviceState] = {}
        self.gemms: dict[int, GemmState] = {}
        self.sources = Sources()
        self._tile_gemm: dict[int, int] = {}  # tile id -> gemm id, for tiles of live GEMMs
        self._holders: dict[int, dict[int, float]] = {}  # outstanding tile -> {device: deadline}
        self._queued = 0  # mirror of the store's queued count, so idle dispatches cost no query
        self.progress = Progress(steps=store.job(job_id).steps)
        self.finished = False
        self.verify_seconds = 0.0
        # Largest residual/tolerance accepted, per GEMM kind: how close honest work comes to a reject.
        self.verify_worst_honest: dict[str, float] = {}

    # ------------------------------------------------------------------ devices

    @property
    def active_devices(self) -> int:
        """Connected and not paused by their owners: the devices that can take work now."""
        return sum(1 for d in self.devices.values() if d.paused is None)

    def check_token(self, token: str) -> None:
        if not hmac.compare_digest(token.encode(), self.token.encode()):
            raise AuthError("wrong join token")

    def connect(self, hello: Hello, now: float) -> tuple[int, list[Outbound]]:
        """Register a device. Raises AuthError on a wrong token (the server closes with 4001)."""
        self.check_token(hello.token)
        info = DeviceInfo(
            name=hello.name[:64] or "device", platform=hello.platform[:128], cores=max(1, hello.cores),
            memory_bytes=max(0, hello.memory_bytes), device=hello.device[:16], gflops=max(0.0, hello.gflops),
        )
        device_id = self.store.add_device(self.job_id, info, now)
        slots = min(MAX_SLOTS, max(1, hello.slots))
        # Until it has returned work, assume a device is 4x slower than its own benchmark.
        per_gflop = 4.0 / info.gflops if info.gflops > 0 else 1.0
        self.devices[device_id] = DeviceState(device_id, info.name, slots, info.gflops, info.device, now, per_gflop,
                                              budget=max(0, hello.block_budget))
        welcome = Welcome(device_id, self.job_name, slots, self.faults.heartbeat)
        out: list[Outbound] = [self._send(device_id, welcome, now)]
        if self.finished:
            out.append(self._send(device_id, Finished(), now))
            return device_id, out
        return device_id, out + self._dispatch(now)

    def disconnect(self, device_id: int, now: float, reason: str = "connection closed") -> list[Outbound]:
        """A device is gone: its outstanding tiles go straight back to the queue and to others."""
        dev = self.devices.pop(device_id, None)
        if dev is None:
            return []
        graceful = reason in ("left", SHUTDOWN)  # neither is the device's fault
        held = list(dev.inflight)
        requeued = self.store.release_device(device_id, "released" if graceful else "lost", now, reason)
        self._queued += len(requeued)
        for tile_id in held:
            self._unhold(tile_id, device_id)
        if held and not graceful:
            self.store.credit_device(device_id, lost=len(held), now=now)
        state = "banned" if dev.consecutive_rejects >= self.max_consecutive_rejects else "offline"
        self.store.set_device_state(device_id, state, now, reason)
        return self._dispatch(now)

    # ------------------------------------------------------------------ messages

    def handle(self, device_id: int, msg: Message, now: float) -> list[Outbound]:
        dev = self.devices.get(device_id)
        if dev is None:
            return []
        dev.last_seen = now
        if isinstance(msg, Result):
            return self._on_result(dev, msg, now)
        if isinstance(msg, Heartbeat):
            return []
        if isinstance(msg, Release):
            return self._on_release(dev, msg, now)
        if isinstance(msg, Pause):
            return self._on_pause(dev, msg.reason[:200] or "paused by its owner", now)
        if isinstance(msg, Resume):
            dev.paused = None
            self.store.set_device_state(dev.id, "online", now)
            return self._dispatch(now)
        if isinstance(msg, Leave):
            return self.disconnect(device_id, now, "left")
        if isinstance(msg, StatusRequest):
            return [self._send(device_id, StatusReply(self.status(now)), now)]
        return [self._send(device_id, Error("unexpected", f"{type(msg).__name__} is not a message a device may send"), now)]

    def tick(self, now: float) -> list[Outbound]:
        """Time passes: drop silent devices, copy tiles whose deadline passed, keep heartbeats."""
        out: list[Outbound] = []
        for dev in list(self.devices.values()):
            if now - dev.last_seen > self.faults.heartbeat_timeout:
                silence = f"no heartbeat for {now - dev.last_seen:.1f} s"
                out.append(Close(dev.id, CLOSE_SILENT, silence))
                out.extend(self.disconnect(dev.id, now, silence))
                continue
            if dev.gflop_verified != dev.credit_sent and now - dev.credit_at >= CREDIT_INTERVAL:
                out.append(self._credit(dev, now))  # verified work only, never claims
            if now - dev.last_sent >= self.faults.heartbeat:
                out.append(self._send(dev.id, Heartbeat(now), now))
        out.extend(self._dispatch(now))
        return out

    def _credit(self, dev: DeviceState, now: float) -> Send:
        dev.credit_sent, dev.credit_at = dev.gflop_verified, now
        name_total = self.store.credit_by_name().get(dev.name, (0.0, 0))[0]
        return self._send(dev.id, Credit(round(dev.gflop_verified, 6), round(name_total, 6)), now)

    def _send(self, device_id: int, message: Message, now: float) -> Send:
        dev = self.devices.get(device_id)
        if dev is not None:
            dev.last_sent = now
        return Send(device_id, message)

    def _on_result(self, dev: DeviceState, msg: Result, now: float) -> list[Outbound]:
        if msg.tile_id not in dev.inflight:
            if dev.cancelled.pop(msg.tile_id, False) is None:  # a copy that lost the race: ignored
                return []
            return [self._send(dev.id, Error("not_leased", f"tile {msg.tile_id} is not leased to you; result ignored"), now)]
        leased_at = dev.inflight.pop(msg.tile_id)
        self._unhold(msg.tile_id, dev.id)
        nbytes = msg.c.numel() * msg.c.element_size()
        dev.bytes_up += nbytes
        gemm = self.gemms[self._tile_gemm[msg.tile_id]]
        tile = gemm.tiles[msg.tile_id]
        ra, rb = gemm.blocks_of(tile)
        started = time.perf_counter()
        verdict = freivalds(ra.logical, rb.logical, msg.c, self.rng, compute_dtype=gemm.a.dtype,
                            a_row_norms=ra.row_norms(), b_norm=rb.norm())
        self.verify_seconds += time.perf_counter() - started
        out: list[Outbound] = []
        if not verdict.ok:
            end = self.store.end_lease(msg.tile_id, dev.id, "rejected", now, verdict.reason)
            self.store.credit_device(dev.id, rejected=1, now=now)
            self._queued += end.requeued
            dev.tiles_rejected += 1
            dev.consecutive_rejects += 1
            out.append(self._send(dev.id, Error("rejected", f"tile {msg.tile_id} failed verification: {verdict.reason}"), now))
            if dev.consecutive_rejects >= self.max_consecutive_rejects:
                out.append(Close(dev.id, CLOSE_BANNED, f"{dev.consecutive_rejects} results in a row failed verification"))
                out.extend(self.disconnect(dev.id, now, "results failed verification"))
                return out
            return out + self._dispatch(now)
        kind = gemm.kind.value
        self.verify_worst_honest[kind] = max(self.verify_worst_honest.get(kind, 0.0), verdict.worst_ratio)
        end = self.store.end_lease(msg.tile_id, dev.id, "verified", now)
        self.store.credit_device(dev.id, verified=1, gflop=tile.flops / 1e9, now=now)
        dev.gflop_verified += tile.flops / 1e9
        dev.tiles_done += 1
        dev.consecutive_rejects = 0
        dev.compute_seconds += msg.seconds
        gflop = tile.flops / 1e9
        if msg.seconds >= 1e-6:  # a device's own timing: believed only within physical reason
            observed = min(gflop / msg.seconds, 1e7)
            dev.gflops = (1 - EMA) * dev.gflops + EMA * observed if dev.gflops else observed
        if gflop > 0:
            dev.seconds_per_gflop = (1 - EMA) * dev.seconds_per_gflop + EMA * (now - leased_at) / gflop
        for loser in end.cancelled:  # other copies lost the race: tell their devices to drop them
            other = self.devices.get(loser)
            if other is not None and msg.tile_id in other.inflight:
                other.cancel(msg.tile_id)
                out.append(self._send(loser, Cancel((msg.tile_id,), "another copy was verified first"), now))
        self._holders.pop(msg.tile_id, None)
        gemm.parts[tile.index] = msg.c
        if gemm.done:
            self._complete(gemm, now)
        return out + self._dispatch(now)

    def _on_pause(self, dev: DeviceState, reason: str, now: float) -> list[Outbound]:
        """The owner needs the machine: its tiles go to others at once; it stays connected."""
        dev.paused = reason
        self.store.set_device_state(dev.id, "paused", now, reason)
        # A paused client keeps its cached blocks: they serve it again once it resumes.
        return self._give_back(dev, tuple(dev.inflight), f"paused: {reason}", now, blocks_lost=False)

    def _on_release(self, dev: DeviceState, msg: Release, now: float) -> list[Outbound]:
        # A missing block: send the blocks again if it gets the tile back. Anything else (its
        # compute failed): the tile goes to another device, never straight back to this one.
        missing = msg.reason.startswith(MISSING_BLOCK)
        return self._give_back(dev, msg.tile_ids, msg.reason[:200], now, blocks_lost=missing, bar=not missing)

    def _give_back(
        self, dev: DeviceState, tile_ids: tuple[int, ...], reason: str, now: float, *, blocks_lost: bool,
        bar: bool = False,
    ) -> list[Outbound]:
        for tile_id in tile_ids:
            if dev.inflight.pop(tile_id, None) is None:
                continue  # already finished or re-issued: nothing to give back
            self._unhold(tile_id, dev.id)
            self._queued += self.store.end_lease(tile_id, dev.id, "released", now, reason, bar=bar).requeued
            if blocks_lost:
                gemm = self.gemms[self._tile_gemm[tile_id]]
                for ref in gemm.blocks_of(gemm.tiles[tile_id]):
                    dev.lose(ref)
        return self._dispatch(now)

    def _complete(self, gemm: GemmState, now: float) -> None:
        result = assemble(gemm.plan, gemm.parts, gemm.a.dtype)
        self.store.finish_gemm(gemm.id, now)
        for tid in gemm.tiles:
            self._tile_gemm.pop(tid, None)
        # dW is the last reader of its X and dY: their cached pieces can go everywhere.
        last_use = gemm.kind is GemmKind.GRAD_WEIGHT
        for src in gemm.sources:
            if self.sources.release(src, last_use=last_use):
                self._forget(src.id)
        del self.gemms[gemm.id]
        gemm.on_done(result)

    def _forget(self, namespace: int) -> None:
        for dev in self.devices.values():
            dev.drop(namespace)

    def begin_step(self, step: int) -> None:
        """A training step starts: blocks still kept from the last one will not be read again."""
        self.progress.current = step
        for namespace in self.sources.sweep():
            self._forget(namespace)

    # ------------------------------------------------------------------ GEMMs

    def submit(
        self, a: torch.Tensor, b: torch.Tensor, kind: GemmKind, now: float, on_done: Callable[[torch.Tensor], None]
    ) -> tuple[int, list[Outbound]]:
        """Queue ``a @ b`` as tiles; ``on_done(result)`` is called once every tile is verified."""
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
            raise ValueError(f"cannot multiply {tuple(a.shape)} by {tuple(b.shape)}")
        if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"unsupported GEMM dtypes {a.dtype}, {b.dtype}")
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            # Honest devices would return NaN/Inf, verification would reject them all and ban
            # innocent volunteers: stop here, where the cause is (training diverged).
            raise FloatingPointError(
                f"a {kind.value} GEMM input holds NaN or Inf: training diverged (try a lower --lr)"
            )
        m, k = a.shape
        n = b.shape[1]
        plan = plan_gemm(m, n, k, kind, max(1, self.active_devices), self.policy)
        tiles = plan.tiles
        a, b = a.detach(), b.detach()
        # Forward's X and dX's dY are read again by the dW that follows: keep them on devices.
        sources = (self.sources.acquire(a, retain=kind in (GemmKind.FORWARD, GemmKind.GRAD_INPUT)),
                   self.sources.acquire(b, retain=False))
        gemm_id = self.store.next_gemm_id()
        a_blocks = {(t.i, t.p): block_ref(sources[0], gemm_id, f"a{t.i}.{t.p}", a_block(a, t)) for t in tiles}
        b_blocks = {(t.p, t.j): block_ref(sources[1], gemm_id, f"b{t.p}.{t.j}", b_block(b, t)) for t in tiles}
        new = [NewTile(t.index, a_blocks[(t.i, t.p)].key, b_blocks[(t.p, t.j)].key, t.flops) for t in tiles]
        ids = self.store.add_gemm(gemm_id, self.job_id, self.progress.current, kind.value, (m, n, k), new, now)
        gemm = GemmState(gemm_id, kind, a, b, plan, dict(zip(ids, tiles)), on_done, sources, a_blocks, b_blocks)
        self.gemms[gemm_id] = gemm
        for tid in ids:
            self._tile_gemm[tid] = gemm_id
        self._queued += len(ids)
        return gemm_id, self._dispatch(now)

    def _dispatch(self, now: float) -> list[Outbound]:
        """Lease queued tiles to devices with free slots, one tile per device per round; then
        copy tiles whose deadline passed, then speculate on stragglers for devices still idle."""
        out: list[Outbound] = []
        hungry = [d for d in self.devices.values() if d.free > 0]
        while self._queued > 0 and hungry:
            hungry.sort(key=lambda d: len(d.inflight) / d.slots)
            still = []
            for dev in hungry:
                if self._queued <= 0:
                    break
                claimed = self.store.claim_tile(dev.id, sorted(dev.blocks), now)
                if claimed is None:
                    continue  # everything queued is barred for this device
                self._queued -= 1
                out.append(self._lease(dev, claimed.id, now))
                if dev.free > 0:
                    still.append(dev)
            hungry = still
        if self._holders:
            out.extend(self._copy_late_tiles(now))
        return out

    def _copy_late_tiles(self, now: float) -> list[Outbound]:
        out: list[Outbound] = []
        idle = sorted((d for d in self.devices.values() if d.free > 0), key=lambda d: -d.free)
        if not idle:
            return out
        f = self.faults
        for tile_id, holders in sorted(self._holders.items()):  # oldest tiles first
            if not idle:
                break
            late = [d for d, deadline in holders.items() if deadline <= now]
            if late:
                issued, limit = DEADLINE, f.max_copies + 1  # a passed deadline may exceed max_copies
            elif self._queued == 0 and len(holders) < f.max_copies:
                # Copy when the tile has been out much longer than an idle device would need:
                # a device known to be slow earns no extra patience.
                flops = self.gemms[self._tile_gemm[tile_id]].tiles[tile_id].flops
                oldest = min(self.devices[d].inflight[tile_id] for d in holders)
                fastest = min(d.expected(flops) for d in idle)
                if now - oldest < max(f.speculate_after, f.speculate_factor * fastest):
                    continue
                issued, limit = SPECULATIVE, f.max_copies
            else:
                continue
            if len(holders) >= limit:
                continue
            for dev in idle:
                if dev.id in holders or self.store.claim_copy(tile_id, dev.id, issued, now) is None:
                    continue
                out.append(self._lease(dev, tile_id, now))
                for d in late:  # each passed deadline buys one copy
                    holders[d] = float("inf")
                if dev.free <= 0:
                    idle.remove(dev)
                break
        return out

    def _unhold(self, tile_id: int, device_id: int) -> None:
        holders = self._holders.get(tile_id)
        if holders is not None:
            holders.pop(device_id, None)
            if not holders:
                del self._holders[tile_id]

    def _lease(self, dev: DeviceState, tile_id: int, now: float) -> Send:
        gemm = self.gemms[self._tile_gemm[tile_id]]
        flops = gemm.tiles[tile_id].flops
        # Queued behind its other tiles on the device: the deadline allows for them too.
        wait = dev.expected(flops) * (len(dev.inflight) + 1)
        self._holders.setdefault(tile_id, {})[dev.id] = now + self.faults.lease_floor + self.faults.lease_factor * wait
        dev.inflight[tile_id] = now
        return self._send(dev.id, self._work(dev, gemm, tile_id), now)

    def _work(self, dev: DeviceState, gemm: GemmState, tile_id: int) -> Work:
        ra, rb = gemm.blocks_of(gemm.tiles[tile_id])
        # Forget first: a namespace dropped and a block of a new one may share this message.
        forget = tuple(sorted(dev.forget))
        dev.forget.clear()
        blocks = []
        for ref in (ra, rb) if ra is not rb else (ra,):
            if ref.key not in dev.blocks:
                blocks.append(Block(ref.key, ref.wire()))
                dev.hold(ref)
                dev.bytes_down += ref.nbytes
        return Work(tile_id, ra.key, rb.key, ra.transposed, rb.transposed, tuple(blocks), forget)

    # ------------------------------------------------------------------ job

    def finish(self, now: float, reason: str = "job complete") -> list[Outbound]:
        """The job is over: tell every device. The server then closes their sockets."""
        self.finished = True
        self.progress.state = "finished"
        out: list[Outbound] = []
        for dev in list(self.devices.values()):
            out.append(self._credit(dev, now))  # the final tally, before goodbye
            out.append(self._send(dev.id, Finished(reason), now))
        return out

    def status(self, now: float) -> dict[str, Any]:
        """The snapshot ``cleave status`` renders (its --json keys are a contract)."""
        counts = self.store.tile_counts(self.job_id)
        rows = []
        for row in self.store.devices(self.job_id):
            live = self.devices.get(row.id)
            if live is None:
                state = row.state
            elif live.paused is not None:
                state = "paused"
            else:
                state = "working" if live.inflight else "idle"
            rows.append({
                "id": row.id, "name": row.name, "state": state, "device": row.device,
                "tiles_done": row.tiles_done, "tiles_rejected": row.tiles_rejected, "tiles_lost": row.tiles_lost,
                "reliability": round(row.reliability, 4),
                "gflops": round(live.gflops if live else row.gflops, 2),
                "gflop_verified": round(row.gflop_verified, 3), "reason": row.reason,
                "inflight": len(live.inflight) if live else 0,
                "mb_down": round((live.bytes_down if live else 0) / 1e6, 2),
                "mb_up": round((live.bytes_up if live else 0) / 1e6, 2),
                "compute_s": round(live.compute_seconds, 4) if live else None,
            })
        p = self.progress
        tiles = {k: counts[k] for k in ("queued", "leased", "verified", "rejected", "requeued", "expired",
                                        "speculative", "cancelled", "lost")}
        return {
            "job": {"name": self.job_name, "step": p.step, "steps": p.steps, "loss": p.loss,
                    "state": p.state, "tokens_per_s": round(p.tokens_per_s, 1)},
            "devices": rows,
            "tiles": tiles,
            "queue_depth": counts["queued"],
            "gemms_in_flight": len(self.gemms),
            "leaderboard": [
                {"name": name, "gflop": round(gflop, 3), "tiles": tiles}
                for name, (gflop, tiles) in sorted(self.store.credit_by_name().items(), key=lambda kv: -kv[1][0])[:10]
            ],
            "verify": {"seconds": round(self.verify_seconds, 4),
                       "worst_honest_ratio": round(max(self.verify_worst_honest.values(), default=0.0), 4),
                       "worst_honest_by_kind": {k: round(v, 4) for k, v in sorted(self.verify_worst_honest.items())}},
            "time": now,
        }
